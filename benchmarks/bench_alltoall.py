"""All-to-all on gloo, side by side in one run, 2 and 4 ranks, 4 KB to 64 MB a rank:

* **plugin**: ``dist.alltoall_single`` with ``paddle_hybrid`` (the pairwise exchange in C++ on the
  group's gloo context);
* **all_gather exchange**: what one writes without it: all_gather every rank's whole input, keep
  the parts addressed to this rank (moves ``n`` times the bytes);
* **all_reduce, same bytes**: one gloo ``all_reduce`` of a buffer as large as a rank's input
  (an all-to-all moves about half the bytes of an all_reduce: the target is <= 1.0x its time);
* **torch all_to_all_single**: PyTorch's on gloo (``--torch-python PATH`` names an interpreter
  with torch, default this one; without torch the column says why; target <= 1.2x its time).

Also one MoE step (``MoELayer``, naive top-2 gate, forward + backward) with experts over EP=2
against one process holding all experts and running both ranks' tokens.

Per cell: the median of repeated calls after one warm-up (each call timed between barriers, the
slowest rank's time).  Prints a table and writes ``benchmarks/results/alltoall.json``.

    python benchmarks/bench_alltoall.py                 # 2 and 4 ranks
    python benchmarks/bench_alltoall.py --ranks 2 --max-mb 16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
SIZES_KB = [4, 64, 1024, 16 * 1024, 64 * 1024]


def _reps(nbytes):
    return max(3, min(50, int(64e6 / max(nbytes, 1)) // 4))


# ---------------------------------------------------------------------------
# workers (run under the launcher)
# ---------------------------------------------------------------------------

def _time(fn, reps, barrier, reduce_max):
    fn()
    times = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(reduce_max(time.perf_counter() - start))
    return statistics.median(times)


def paddle_worker(max_kb, out_path):
    import numpy as np
    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401

    dist.init_parallel_env()
    n, rank = dist.get_world_size(), dist.get_rank()

    def reduce_max(value):
        t = paddle.to_tensor([value], dtype="float64")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.numpy()[0])

    rows = {}
    for kb in [s for s in SIZES_KB if s <= max_kb]:
        elems = kb * 1024 // 4
        elems -= elems % n
        x = paddle.to_tensor(np.full([elems], rank, dtype="float32"))
        out = paddle.empty_like(x)

        def plugin():
            dist.alltoall_single(out, x)

        def gather_exchange():
            everything = []
            dist.all_gather(everything, x)
            mine = [part.reshape([n, -1])[rank] for part in everything]
            paddle.assign(paddle.concat(mine), output=out)

        def all_reduce():
            y = x.clone()
            dist.all_reduce(y)

        reps = _reps(elems * 4)
        rows[kb] = {name: _time(fn, reps, dist.barrier, reduce_max)
                    for name, fn in (("plugin", plugin), ("all_gather", gather_exchange), ("all_reduce", all_reduce))}
    if n == 2:
        rows["moe_step"] = moe_step_times(dist, reduce_max)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def moe_step_times(dist, reduce_max):
    """EP=2 MoE forward + backward vs one process (in rank 0) holding all experts and both
    ranks' tokens; tokens 2 x 512 a rank, d_model 256, 4 experts a rank, hidden 512."""
    import numpy as np
    import paddle
    from paddle import nn
    from paddle.incubate.distributed.models.moe import MoELayer

    d, hidden, tokens, per_rank = 256, 512, 512, 4

    def experts(count):
        return nn.LayerList([nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                             for _ in range(count)])

    paddle.seed(1)
    ep = MoELayer(d, experts(per_rank), gate={"type": "naive", "top_k": 2},
                  moe_group=dist.collective._get_global_group())
    x = paddle.to_tensor(np.random.default_rng(dist.get_rank()).normal(size=[2, tokens, d]).astype("float32"))

    def ep_step():
        ep(x * 1.0).sum().backward()

    result = {"ep2": _time(ep_step, 5, dist.barrier, reduce_max)}
    if dist.get_rank() == 0:
        one = MoELayer(d, experts(2 * per_rank), gate={"type": "naive", "top_k": 2}, moe_group=None)
        both = paddle.concat([x, x], axis=0)

        def one_step():
            one(both * 1.0).sum().backward()

        result["one_process"] = _time(one_step, 5, lambda: None, lambda v: v)
    return result


def torch_worker(max_kb, out_path):
    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    n, rank = tdist.get_world_size(), tdist.get_rank()
    torch.set_num_threads(1)

    def reduce_max(value):
        t = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return float(t[0])

    rows = {}
    for kb in [s for s in SIZES_KB if s <= max_kb]:
        elems = kb * 1024 // 4
        elems -= elems % n
        x = torch.full([elems], float(rank))
        out = torch.empty_like(x)
        rows[kb] = {"torch": _time(lambda: tdist.all_to_all_single(out, x), _reps(elems * 4), tdist.barrier,
                                   reduce_max)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    tdist.destroy_process_group()


# ---------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------

def _run(cmd, env):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def torch_python(given: str | None):
    """The interpreter with PyTorch: ``given`` (``--torch-python``, or ``PADDLE_HYBRID_TORCH_PYTHON``),
    else this one if it imports torch; ``(python, None)`` or ``(None, why not)``."""
    given = given or os.environ.get("PADDLE_HYBRID_TORCH_PYTHON")
    python = given or sys.executable
    probe = subprocess.run([python, "-c", "import torch, torch.distributed as d; assert d.is_gloo_available()"],
                           capture_output=True, text=True)
    if probe.returncode:
        return None, f"no PyTorch with gloo in {python} ({probe.stderr.strip().splitlines()[-1:]}); " \
                     "give --torch-python PATH (or PADDLE_HYBRID_TORCH_PYTHON) for its columns"
    return python, None


def run_torch(python, script, ranks, max_kb, out, work, env):
    """``script --worker torch`` on ``ranks`` PyTorch gloo ranks with ``python``; its JSON rows."""
    _run([python, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(_free_port()),
          script, "--worker", "torch", "--max-kb", str(max_kb), "--out", out], env)
    with open(out) as f:
        return json.load(f)


def measure(ranks, max_kb, work, torch_exe=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PYTHONPATH=ROOT)
    out = os.path.join(work, f"paddle{ranks}.json")
    _run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks), "--log_dir",
          os.path.join(work, f"log{ranks}"), __file__, "--worker", "paddle", "--max-kb", str(max_kb), "--out", out],
         env)
    with open(out) as f:
        rows = json.load(f)
    python, torch_note = torch_exe or (None, "no PyTorch")
    if python:
        for kb, cell in run_torch(python, __file__, ranks, max_kb, os.path.join(work, f"torch{ranks}.json"), work,
                                  env).items():
            rows[kb].update(cell)
    return rows, torch_note or ""


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt_ms(seconds):
    return f"{seconds * 1e3:9.3f}"


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
    torch_exe = torch_python(args.torch_python)

    max_kb = int(args.max_mb * 1024)
    report = {"date": time.strftime("%Y-%m-%d"), "sizes_kb": [s for s in SIZES_KB if s <= max_kb], "ranks": {}}
    with tempfile.TemporaryDirectory() as work:
        for ranks in args.ranks:
            rows, note = measure(ranks, max_kb, work, torch_exe)
            report["ranks"][ranks] = rows
            print(f"\n{ranks} ranks, ms per call (median; slowest rank){'; ' + note if note else ''}")
            print(f"{'KB a rank':>10} {'plugin':>9} {'all_gather':>10} {'all_reduce':>10} {'torch':>9}  "
                  f"{'plugin/all_reduce':>17} {'plugin/torch':>12}")
            for kb in report["sizes_kb"]:
                cell = rows[str(kb)]
                torch_t = cell.get("torch")
                print(f"{kb:>10} {_fmt_ms(cell['plugin'])} {_fmt_ms(cell['all_gather']):>10} "
                      f"{_fmt_ms(cell['all_reduce']):>10} {_fmt_ms(torch_t) if torch_t else '        -'}  "
                      f"{cell['plugin'] / cell['all_reduce']:17.2f} "
                      f"{(cell['plugin'] / torch_t) if torch_t else float('nan'):12.2f}")
            if "moe_step" in rows:
                moe = rows["moe_step"]
                print(f"MoE step (fwd+bwd, 2 x 512 tokens a rank): EP=2 {moe['ep2'] * 1e3:.1f} ms, one process with "
                      f"every expert and both ranks' tokens {moe['one_process'] * 1e3:.1f} ms")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "alltoall.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
