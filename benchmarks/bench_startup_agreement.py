"""What the start-up agreement costs: ``fleet.distributed_model`` of a 2-stage pipeline model on
2 gloo ranks, with the agreement (the default) and without (``PADDLE_HYBRID_STARTUP_AGREEMENT=0``),
measured side by side in one run.

Per run and rank: the seconds ``distributed_model`` took, and the agreement's own duration
(publish, wait for the other rank, compare; ``paddle_hybrid.dygraph.agreement.last_duration``).
The table gives medians over the runs and both ranks, in milliseconds.  The agreement waits for
the slower rank, so its duration includes how far apart the ranks reached the call.

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
    fleet.init(is_collective=True, strategy=strategy)
    model = PipelineLayer([LayerDesc(paddle.nn.Linear, 16, 16) for _ in range(4)], num_stages=2,
                          loss_fn=paddle.nn.MSELoss())
    paddle.distributed.barrier()  # both ranks reach the call together
    start = time.perf_counter()
    fleet.distributed_model(model)
    save_result({"distributed_model": time.perf_counter() - start,
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

    runs = {"agreement on (default)": [], "agreement off": []}
    for _ in range(args.runs):
        for label, value in (("agreement on (default)", "1"), ("agreement off", "0")):
            results = launch(__file__, 2, args=["--worker"], timeout=300,
                             env={"PADDLE_HYBRID_STARTUP_AGREEMENT": value, "OMP_NUM_THREADS": "1"})
            runs[label].extend(results)
    table = {}
    for label, results in runs.items():
        checks = [r["agreement"] for r in results if r["agreement"] is not None]
        table[label] = {"distributed_model_ms": 1000 * statistics.median(r["distributed_model"] for r in results),
                        "agreement_ms": 1000 * statistics.median(checks) if checks else None}
    print(f"{'2 ranks, PP2, CPU/gloo':28s} {'distributed_model (ms)':>24s} {'agreement itself (ms)':>22s}")
    for label, row in table.items():
        check = f"{row['agreement_ms']:.1f}" if row["agreement_ms"] is not None else "-"
        print(f"{label:28s} {row['distributed_model_ms']:24.1f} {check:>22s}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
