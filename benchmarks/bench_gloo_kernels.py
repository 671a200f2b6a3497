"""The plugin's C++ gloo kernels (``paddle_hybrid.gloo.kernels``), side by side in one run, 2 and 4
ranks, 4 KB to 64 MB a rank:

* **reduce_scatter**: the kernel (a ring: each rank sends (n - 1) / n of its input), against the
  Python emulation it replaced for sums (``all_reduce`` of the whole input and a slice) and one
  ``all_reduce`` of the same bytes (target: <= 0.7x its time from 1 MB up);
* **all_to_all**: the kernel (``_C_ops.all_to_all``: pairwise rounds in C++) and
  ``dist.alltoall_single`` on the process group (the same rounds in C++, ``ph_gloo_all_to_all_v``),
  against an ``all_reduce`` of the same bytes (target <= 1.0x) and PyTorch's gloo
  ``all_to_all_single`` (target <= 1.2x);
* **P -> S reshard**: ``dist.reshard(Partial -> Shard(0))`` of the same bytes (Paddle's C++
  reshard function calling the kernel), against PyTorch DTensor ``redistribute(Partial -> Shard(0))``.

PyTorch's columns (``t_*``: all_to_all_single, reduce_scatter_tensor, all_reduce, DTensor
redistribute) run under ``--torch-python PATH`` (default this interpreter, if it has torch);
without torch the table says so.  Per cell: the median of repeated calls after one warm-up, each
timed between barriers, the slowest rank's time.  Prints a table and writes
``benchmarks/results/gloo_kernels.json``.

    python benchmarks/bench_gloo_kernels.py                 # 2 and 4 ranks
    python benchmarks/bench_gloo_kernels.py --ranks 2 --max-mb 16 --torch-python /path/to/python
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
from bench_alltoall import SIZES_KB, _fmt_ms, _reps, _run, _time, run_torch, torch_python  # noqa: E402

ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
COLUMNS = ("rs_kernel", "rs_emulation", "a2a_kernel", "a2a_group", "all_reduce", "p_to_s")
TORCH_COLUMNS = ("t_rs", "t_a2a", "t_all_reduce", "t_p_to_s")


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
            "a2a_group": lambda: dist.alltoall_single(out, x),
            "all_reduce": all_reduce,
            "p_to_s": lambda: dist.reshard(partial, mesh, [dist.Shard(0)]),
        }
        reps = _reps(elems * 4)
        rows[kb] = {name: _time(fn, reps, dist.barrier, reduce_max) for name, fn in cells.items()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def torch_worker(max_kb, out_path):
    """The same cells in PyTorch on gloo (run under ``torch.distributed.run``)."""
    import torch
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor, Partial, Shard, init_device_mesh

    tdist.init_process_group("gloo")
    torch.set_num_threads(1)
    n, rank = tdist.get_world_size(), tdist.get_rank()
    mesh = init_device_mesh("cpu", (n,))

    def reduce_max(value):
        t = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t[0])

    rows = {}
    for kb in [s for s in SIZES_KB if s <= max_kb]:
        elems = kb * 1024 // 4
        elems -= elems % n
        x = torch.full([elems], float(rank + 1))
        out, chunk = torch.empty_like(x), torch.empty([elems // n])
        partial = DTensor.from_local(x, mesh, [Partial()])

        def all_reduce():
            tdist.all_reduce(x.clone())

        cells = {
            "t_rs": lambda: tdist.reduce_scatter_tensor(chunk, x),
            "t_a2a": lambda: tdist.all_to_all_single(out, x),
            "t_all_reduce": all_reduce,
            "t_p_to_s": lambda: partial.redistribute(mesh, [Shard(0)]).to_local(),
        }
        rows[kb] = {name: _time(fn, _reps(elems * 4), tdist.barrier, reduce_max) for name, fn in cells.items()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    tdist.destroy_process_group()


def measure(ranks, max_kb, work, torch_exe):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PYTHONPATH=ROOT)
    out = os.path.join(work, f"paddle{ranks}.json")
    _run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks), "--log_dir",
          os.path.join(work, f"log{ranks}"), __file__, "--worker", "paddle", "--max-kb", str(max_kb), "--out", out],
         env)
    with open(out) as f:
        rows = json.load(f)
    python, _ = torch_exe
    if python:
        for kb, cell in run_torch(python, __file__, ranks, max_kb, os.path.join(work, f"torch{ranks}.json"), work,
                                  env).items():
            rows[kb].update(cell)
    return rows


def _ratio(cell, a, b) -> str:
    return f"{cell[a] / cell[b]:.2f}" if a in cell and b in cell else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--worker", choices=["paddle", "torch"])
    parser.add_argument("--max-kb", type=int)
    parser.add_argument("--out")
    parser.add_argument("--torch-python", help="a Python with PyTorch (default: this one, if it has torch)")
    args = parser.parse_args()
    if args.worker == "paddle":
        return paddle_worker(args.max_kb, args.out)
    if args.worker == "torch":
        return torch_worker(args.max_kb, args.out)

    max_kb = int(args.max_mb * 1024)
    torch_exe = torch_python(args.torch_python)
    report = {"date": time.strftime("%Y-%m-%d"), "sizes_kb": [s for s in SIZES_KB if s <= max_kb], "ranks": {},
              "note": torch_exe[1] or f"PyTorch columns from {torch_exe[0]}"}
    print(report["note"])
    ratios = (("rs/all_red", "rs_kernel", "all_reduce"), ("a2a/all_red", "a2a_kernel", "all_reduce"),
              ("grp/all_red", "a2a_group", "all_reduce"), ("a2a/torch", "a2a_kernel", "t_a2a"),
              ("grp/torch", "a2a_group", "t_a2a"), ("p2s/torch", "p_to_s", "t_p_to_s"))
    with tempfile.TemporaryDirectory() as work:
        for ranks in args.ranks:
            rows = measure(ranks, max_kb, work, torch_exe)
            report["ranks"][ranks] = rows
            columns = COLUMNS + (TORCH_COLUMNS if torch_exe[0] else ())
            print(f"\n{ranks} ranks, ms per call (median; slowest rank)")
            print(f"{'KB a rank':>10} " + " ".join(f"{c:>12}" for c in columns)
                  + " " + " ".join(f"{r[0]:>11}" for r in ratios))
            for kb in report["sizes_kb"]:
                cell = rows[str(kb)]
                print(f"{kb:>10} " + " ".join(f"{_fmt_ms(cell[c]):>12}" for c in columns)
                      + " " + " ".join(f"{_ratio(cell, a, b):>11}" for _, a, b in ratios))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gloo_kernels.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
