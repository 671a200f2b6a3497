"""What start-up costs through the job's store: ``fleet.init`` after ``init_parallel_env`` (fleet's
gloo groups, each rendezvousing on the store) and ``fleet.distributed_model`` of a 2-stage
pipeline model on 2 gloo ranks, measured side by side in one run in three configurations: the
default; the agreement off
(``PADDLE_HYBRID_AGREEMENT=0``); the store with Nagle's delay as Paddle makes it
(``PADDLE_HYBRID_STORE_NODELAY=0``).

Per run and rank: the seconds ``fleet.init`` and ``distributed_model`` took, and the agreement's
own duration (publish, wait for the other rank, compare;
``paddle_hybrid.dygraph.agreement.last_duration``).  The table gives medians over the runs and both
ranks, in milliseconds.  The agreement waits for the slower rank, so its duration includes how far
apart the ranks reached the call.

    python benchmarks/bench_startup_agreement.py                  # 5 runs each
    python benchmarks/bench_startup_agreement.py --runs 10 --out agreement.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def worker() -> None:
    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.dygraph import agreement
    from paddle_hybrid.testing import save_result

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 2}
    strategy.pipeline_configs = {"accumulate_steps": 4, "micro_batch_size": 2}
    paddle.distributed.init_parallel_env()  # the job's store and global group (their start-up skew)
    paddle.distributed.barrier()  # both ranks reach fleet.init together
    start = time.perf_counter()
    fleet.init(is_collective=True, strategy=strategy)  # fleet's groups, on the store made above
    fleet_init = time.perf_counter() - start
    model = PipelineLayer([LayerDesc(paddle.nn.Linear, 16, 16) for _ in range(4)], num_stages=2,
                          loss_fn=paddle.nn.MSELoss())
    paddle.distributed.barrier()  # both ranks reach the call together
    start = time.perf_counter()
    fleet.distributed_model(model)
    save_result({"fleet_init": fleet_init, "distributed_model": time.perf_counter() - start,
                 "agreement": agreement.last_duration[-1] if agreement.last_duration else None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the runs and the table as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    from paddle_hybrid.testing import launch

    arms = {"default": {},
            "agreement off": {"PADDLE_HYBRID_AGREEMENT": "0"},
            "store with Nagle's delay": {"PADDLE_HYBRID_STORE_NODELAY": "0"}}
    runs = {label: [] for label in arms}
    for _ in range(args.runs):
        for label, env in arms.items():
            results = launch(__file__, 2, args=["--worker"], timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
            runs[label].extend(results)
    table = {}
    for label, results in runs.items():
        checks = [r["agreement"] for r in results if r["agreement"] is not None]
        table[label] = {"fleet_init_ms": 1000 * statistics.median(r["fleet_init"] for r in results),
                        "distributed_model_ms": 1000 * statistics.median(r["distributed_model"] for r in results),
                        "agreement_ms": 1000 * statistics.median(checks) if checks else None}
    print(f"{'2 ranks, PP2, CPU/gloo':26s} {'fleet.init (ms)':>16s} {'distributed_model (ms)':>23s} "
          f"{'agreement itself (ms)':>22s}")
    for label, row in table.items():
        check = f"{row['agreement_ms']:.1f}" if row["agreement_ms"] is not None else "-"
        print(f"{label:26s} {row['fleet_init_ms']:16.1f} {row['distributed_model_ms']:23.1f} {check:>22s}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
