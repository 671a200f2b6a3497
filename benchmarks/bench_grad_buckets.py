"""Per-step gradient sync time on DP=2 (gloo), side by side in one run:

* ``per_param``: scale + one all_reduce per gradient;
* ``fused_allreduce_gradients``: Paddle's (concat into a new buffer, all_reduce, split back);
* ``buckets``: the plugin's persistent fused buckets (all_reduces started during backward,
  waited for when backward returns; the explicit ``finish_grad_sync`` after it is a no-op);
* ``prealloc_limit``: one all_reduce of a preallocated buffer with the same bytes as the buckets.

Model: ``--layers`` Linear(``--width``, ``--width``) + tanh (2 parameters each). Methods are
interleaved step by step; each is timed as barrier -> backward -> sync, and its sync time is the
median of that minus the median of barrier -> backward alone. Medians, slowest rank.

    python benchmarks/bench_grad_buckets.py            # launches 2 ranks, prints the table
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(args):
    import numpy as np
    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients
    from paddle_hybrid.dygraph.grad_buckets import GradBuckets
    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    group = hcg.get_data_parallel_group()

    def make():
        paddle.seed(1)
        layers = []
        for _ in range(args.layers):
            layers += [paddle.nn.Linear(args.width, args.width), paddle.nn.Tanh()]
        return paddle.nn.Sequential(*layers)

    plain, bucketed = make(), make()
    n_params = len(plain.parameters())
    gb = GradBuckets(bucketed.parameters(), group=group, bucket_size_mb=args.bucket_mb)
    orig_finish = gb.finish_grad_sync
    bucket_bytes = sum(b.nbytes for b in gb.buckets)
    prealloc = paddle.zeros([bucket_bytes // 4], dtype="float32")
    x = paddle.to_tensor(np.random.default_rng(dist.get_rank()).standard_normal((8, args.width)).astype("float32"))

    def per_param():
        with paddle.no_grad():
            for p in plain.parameters():
                p.grad.scale_(0.5)
                dist.all_reduce(p.grad, group=group)

    def fused():
        fused_allreduce_gradients(list(plain.parameters()), hcg)

    def prealloc_sync():
        dist.all_reduce(prealloc, group=group)

    # Every method is timed the same way: barrier, backward, its sync; the sync time is that
    # minus the same without any sync ("backward_only"), so every method carries the same
    # rank skew at the end of backward (the buckets' all_reduces start inside backward).
    methods = (("backward_only", plain, lambda: None), ("per_param", plain, per_param),
               ("fused_allreduce_gradients", plain, fused), ("buckets", bucketed, orig_finish),
               ("prealloc_limit", plain, prealloc_sync))
    totals = {name: [] for name, _, _ in methods}
    for it in range(args.warmup + args.iters):
        for name, model, sync in methods:
            dist.barrier(group=group)
            t = time.perf_counter()
            model(x).mean().backward()
            sync()
            dt = time.perf_counter() - t
            for p in model.parameters():
                p.clear_gradient()
            if it >= args.warmup:
                totals[name].append(dt)
    base = statistics.median(totals["backward_only"])
    results = {k: [v - base for v in vals] for k, vals in totals.items() if k != "backward_only"}
    assert gb.stats()["view_repairs"] == 0 and gb.stats()["started_at_finish"] == 0
    save_result({"median_ms": {k: 1e3 * statistics.median(v) for k, v in results.items()},
                 "backward_only_ms": 1e3 * base,
                 "n_params": n_params, "bucket_bytes": bucket_bytes, "num_buckets": len(gb.buckets)})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=110, help="Linear layers (2 parameters each)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=32, help="fuse_grad_size_in_MB")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "grad_buckets.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, ROOT)
    from paddle_hybrid.testing import launch

    argv = [a for a in sys.argv[1:] if not a.startswith("--out")] + ["--worker"]
    res = launch(os.path.abspath(__file__), nprocs=2, args=argv, timeout=600)
    # a step is as slow as its slowest rank
    med = {k: max(r["median_ms"][k] for r in res) for k in res[0]["median_ms"]}
    b = med["buckets"]
    table = {
        "model": f"{args.layers} x Linear({args.width},{args.width}), {res[0]['n_params']} parameters, "
                 f"{res[0]['bucket_bytes']} gradient bytes in {res[0]['num_buckets']} bucket(s)",
        "median_ms_per_step": med,
        "speedup_vs_fused_allreduce_gradients": med["fused_allreduce_gradients"] / b,
        "speedup_vs_per_param": med["per_param"] / b,
        "buckets_over_prealloc_limit": b / med["prealloc_limit"],
        "targets": {"speedup_vs_fused_allreduce_gradients": ">= 1.5", "buckets_over_prealloc_limit": "<= 1.3"},
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
    }
    print(f"gradient sync per step, DP=2 gloo, {table['model']}")
    print(f"{'method':<28}{'median ms':>10}{'vs buckets':>12}")
    for k in ("per_param", "fused_allreduce_gradients", "buckets", "prealloc_limit"):
        print(f"{k:<28}{med[k]:>10.3f}{med[k] / b:>11.2f}x")
    print(f"buckets: {table['speedup_vs_fused_allreduce_gradients']:.2f}x faster than fused_allreduce_gradients "
          f"(target >= 1.5), {table['buckets_over_prealloc_limit']:.2f}x the preallocated limit (target <= 1.3)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=2)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
