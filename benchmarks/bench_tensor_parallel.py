"""Tensor parallel on CPU: examples/gpt_pp.py's GPT trained with TP=2 on 2 processes
against the same model in 1 process, one thread each, side by side in one run.

Per configuration: median step time, tokens/s, and the time per step spent inside the
tensor-parallel collectives (every ``paddle.distributed`` all_reduce / all_gather /
broadcast the step makes, timed around the call; with --pp 1 --dp 1 there are no others).
Rounds alternate 1 process and 2 processes so drift of a shared machine hits both.

    python benchmarks/bench_tensor_parallel.py               # hidden 512, microbatch 8 x 128, 2 rounds
    python benchmarks/bench_tensor_parallel.py --hidden 1024 --rounds 1
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
RESULTS = os.path.join(HERE, "results")
TIMED_COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


class CollectiveClock:
    """Wall time spent inside ``paddle.distributed`` collectives while installed: the
    benchmark's own instrument, put in and taken out through the plugin's Patcher."""

    def __init__(self):
        import paddle.distributed as dist

        from paddle_hybrid.registry.patching import Patcher

        self.seconds, self.calls = 0.0, 0
        self._patcher = Patcher("bench_tensor_parallel", "nothing (a benchmark instrument)")
        for name in TIMED_COLLECTIVES:
            self._patcher.set(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed

    def take(self):
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def remove(self):
        self._patcher.revert()


def worker(argv):
    import paddle.distributed as dist

    from gpt_worker import build_training  # beside this script (a launched rank runs it from here)
    from paddle_hybrid.testing import save_result

    run = build_training(argv)
    args = run.args
    clock = CollectiveClock()
    steps = []
    for step in range(args.steps):
        clock.take()
        t0 = time.perf_counter()
        loss = run.step(step)
        seconds = time.perf_counter() - t0
        comm, calls = clock.take()
        steps.append({"s": seconds, "comm_s": comm, "calls": calls, "loss": float(loss.reshape([-1])[0])})
    clock.remove()
    save_result({"rank": dist.get_rank(), "steps": steps, "tokens_per_step": run.tokens_per_step,
                 "ran": {k: getattr(args, k) for k in ("hidden", "heads", "layers", "seq_len", "mp", "steps")}})


# (label, processes = mp degree, extra example flags); the default TP configuration first
CONFIGS = [
    ("1 process", 1, []),
    ("TP=2, 2 processes", 2, []),
    ("TP=2 + sequence parallel (tuned)", 2, ["--sequence-parallel"]),
]


def run(nprocs, shape, steps, timeout):
    from paddle_hybrid.testing import launch

    argv = shape + ["--pp", "1", "--mp", str(nprocs), "--steps", str(steps)]
    res = launch(os.path.abspath(__file__), nprocs=nprocs, args=["--worker", *argv], timeout=timeout,
                 env={"OMP_NUM_THREADS": "1"})
    ran = res[0]["ran"]
    if ran["mp"] != nprocs or ran["steps"] != steps or str(ran["hidden"]) != shape[shape.index("--hidden") + 1]:
        raise RuntimeError(f"bench_tensor_parallel: the ranks ran {ran}, not the configuration asked for.")
    warm = 2  # the first steps build kernels and buffers
    per_rank = [r["steps"][warm:] for r in res]
    # a step lasts as long as its slowest rank
    step_s = [max(rank[i]["s"] for rank in per_rank) for i in range(len(per_rank[0]))]
    comm_s = [max(rank[i]["comm_s"] for rank in per_rank) for i in range(len(per_rank[0]))]
    return {"step_s": step_s, "comm_s": comm_s, "calls_per_step": per_rank[0][0]["calls"],
            "tokens_per_step": res[0]["tokens_per_step"], "losses": [s["loss"] for s in res[0]["steps"]]}


def main():
    if sys.argv[1:2] == ["--worker"]:  # a launched rank: the rest are the example's flags
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=8, help="the example's default")
    ap.add_argument("--accumulate-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    shape = ["--hidden", str(args.hidden), "--heads", str(args.heads), "--layers", str(args.layers),
             "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
             "--accumulate-steps", str(args.accumulate_steps), "--corpus-chars", "50000"]
    runs = {label: [] for label, _, _ in CONFIGS}
    for _ in range(args.rounds):
        for label, nprocs, extra in CONFIGS:
            runs[label].append(run(nprocs, shape + extra, args.steps, args.timeout))
    rows = {}
    for label, nprocs, _ in CONFIGS:
        step = statistics.median(s for r in runs[label] for s in r["step_s"])
        comm = statistics.median(s for r in runs[label] for s in r["comm_s"])
        rows[label] = {"nprocs": nprocs, "median_step_s": step, "tokens_per_s": runs[label][0]["tokens_per_step"] / step,
                       "tp_collective_s_per_step": comm, "collective_calls_per_step": runs[label][0]["calls_per_step"],
                       "first_losses": runs[label][0]["losses"][:3]}
    one = rows["1 process"]["tokens_per_s"]
    ratio = rows["TP=2, 2 processes"]["tokens_per_s"] / one
    out = {"config": vars(args), "rows": rows, "tp2_over_one_tokens_per_s": ratio,
           "tp2_sp_over_one_tokens_per_s": rows["TP=2 + sequence parallel (tuned)"]["tokens_per_s"] / one,
           "target": 1.3, "met": ratio >= 1.3}
    print(f"tensor parallel on CPU: hidden {args.hidden}, {args.layers} blocks, {args.micro_batch_size * args.accumulate_steps}"
          f" x {args.seq_len} tokens per step, OMP_NUM_THREADS=1, medians over {args.rounds} round(s)")
    print(f"{'configuration':34s} {'step ms':>9s} {'tokens/s':>10s} {'TP collectives ms/step':>24s} {'calls':>6s}")
    for label, r in rows.items():
        print(f"{label:34s} {1000 * r['median_step_s']:9.1f} {r['tokens_per_s']:10.0f} "
              f"{1000 * r['tp_collective_s_per_step']:24.1f} {r['collective_calls_per_step']:6d}")
    print(f"TP=2 / 1 process tokens/s: {ratio:.2f}x (target >= 1.3x: {'met' if ratio >= 1.3 else 'NOT met'}); "
          f"with sequence parallel: {out['tp2_sp_over_one_tokens_per_s']:.2f}x")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tensor_parallel.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
