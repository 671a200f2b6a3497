"""The plugin's C++ gloo kernels (``paddle_hybrid.gloo.kernels``), side by side in one run, 2 and 4
ranks, 4 KB to 64 MB a rank:

* **reduce_scatter**: the kernel (a ring: each rank sends (n - 1) / n of its input), against the
  Python emulation it replaced for sums (``all_reduce`` of the whole input and a slice) and one
  ``all_reduce`` of the same bytes (target: <= 0.7x its time from 1 MB up);
* **all_to_all**: the kernel (``_C_ops.all_to_all``: pairwise rounds in C++), against the Python
  pairwise exchange behind ``dist.alltoall_single`` and an ``all_reduce`` of the same bytes
  (target <= 1.0x);
* **P -> S reshard**: ``dist.reshard(Partial -> Shard(0))`` of the same bytes (Paddle's C++
  reshard function calling the kernel), next to the bare kernel.

PyTorch's columns (``all_to_all_single``, DTensor ``redistribute(Partial -> Shard)``) need torch;
without it the table says so.  Per cell: the median of repeated calls after one warm-up, each
timed between barriers, the slowest rank's time.  Prints a table and writes
``benchmarks/results/gloo_kernels.json``.

    python benchmarks/bench_gloo_kernels.py                 # 2 and 4 ranks
    python benchmarks/bench_gloo_kernels.py --ranks 2 --max-mb 16
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the timing helpers of the all-to-all benchmark, shared
from bench_alltoall import SIZES_KB, _fmt_ms, _reps, _run, _time  # noqa: E402

ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
COLUMNS = ("rs_kernel", "rs_emulation", "a2a_kernel", "a2a_python", "all_reduce", "p_to_s")


def paddle_worker(max_kb, out_path):
    import numpy as np
    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (installs the kernels)

    dist.init_parallel_env()
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])

    def reduce_max(value):
        t = paddle.to_tensor([value], dtype="float64")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.numpy()[0])

    rows = {}
    for kb in [s for s in SIZES_KB if s <= max_kb]:
        elems = kb * 1024 // 4
        elems -= elems % n
        x = paddle.to_tensor(np.full([elems], rank + 1, dtype="float32"))
        out = paddle.empty_like(x)
        partial = dist.auto_parallel.api.dtensor_from_local(x, mesh, [dist.Partial()])

        def rs_emulation():
            y = x.clone()
            dist.all_reduce(y)
            y[rank * (elems // n):(rank + 1) * (elems // n)].clone()

        def all_reduce():
            y = x.clone()
            dist.all_reduce(y)

        cells = {
            "rs_kernel": lambda: paddle._C_ops.reduce_scatter(x, 0, n),
            "rs_emulation": rs_emulation,
            "a2a_kernel": lambda: paddle._C_ops.all_to_all(x, 0),
            "a2a_python": lambda: dist.alltoall_single(out, x),
            "all_reduce": all_reduce,
            "p_to_s": lambda: dist.reshard(partial, mesh, [dist.Shard(0)]),
        }
        reps = _reps(elems * 4)
        rows[kb] = {name: _time(fn, reps, dist.barrier, reduce_max) for name, fn in cells.items()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def measure(ranks, max_kb, work):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PYTHONPATH=ROOT)
    out = os.path.join(work, f"paddle{ranks}.json")
    _run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks), "--log_dir",
          os.path.join(work, f"log{ranks}"), __file__, "--worker", "--max-kb", str(max_kb), "--out", out], env)
    with open(out) as f:
        return json.load(f)


def _torch_note() -> str:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        return f"no PyTorch columns: torch not installed ({exc})"
    return "PyTorch columns: see bench_alltoall.py (all_to_all_single); DTensor redistribute not measured here"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--max-kb", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return paddle_worker(args.max_kb, args.out)

    max_kb = int(args.max_mb * 1024)
    report = {"date": time.strftime("%Y-%m-%d"), "sizes_kb": [s for s in SIZES_KB if s <= max_kb], "ranks": {},
              "note": _torch_note()}
    print(report["note"])
    with tempfile.TemporaryDirectory() as work:
        for ranks in args.ranks:
            rows = measure(ranks, max_kb, work)
            report["ranks"][ranks] = rows
            print(f"\n{ranks} ranks, ms per call (median; slowest rank)")
            print(f"{'KB a rank':>10} " + " ".join(f"{c:>12}" for c in COLUMNS)
                  + f" {'rs/all_red':>10} {'a2a/all_red':>11} {'a2a k/py':>8}")
            for kb in report["sizes_kb"]:
                cell = rows[str(kb)]
                print(f"{kb:>10} " + " ".join(f"{_fmt_ms(cell[c]):>12}" for c in COLUMNS)
                      + f" {cell['rs_kernel'] / cell['all_reduce']:10.2f} {cell['a2a_kernel'] / cell['all_reduce']:11.2f}"
                      f" {cell['a2a_kernel'] / cell['a2a_python']:8.2f}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gloo_kernels.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
