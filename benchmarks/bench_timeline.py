"""Cost of recording the pipeline timeline: examples/gpt_pp.py's default run (PP=2, 2
processes) with and without ``--timeline``, side by side in one run, rounds alternating.

Step time = median of every step after the first three (warm-up), rank 0's clock (every
rank of a pipeline step finishes together).  Target: recording adds at most 3%.  Run to run
noise on a shared 2-core machine is larger than that, so the script also measures the
recorder's own cost in this process (a span opened and closed, per event) and multiplies it by
the events a step records: an estimate of the overhead that noise does not blur.

    python benchmarks/bench_timeline.py                 # 3 rounds x 15 steps each
    python benchmarks/bench_timeline.py --rounds 1 --steps 10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
EXAMPLE = os.path.join(ROOT, "examples", "gpt_pp.py")
WARMUP = 3
CONFIGS = [("PP=2, no recording", []), ("PP=2, --timeline", ["--timeline"])]


def run(extra, steps, timeout):
    """(step times after warm-up, events per rank per step or None)."""
    from paddle_hybrid.testing import launch

    out = tempfile.mkdtemp(prefix="ph_bench_timeline_")
    res = launch(EXAMPLE, nprocs=2, args=["--steps", str(steps), "--out-dir", out, *extra], timeout=timeout,
                 env={"OMP_NUM_THREADS": "1"})
    summary = res[0]["summary"]
    per_step = None
    if "timeline" in summary:
        with open(summary["timeline"]["trace"]) as f:
            n = sum(1 for e in json.load(f)["traceEvents"] if e.get("ph") == "X")
        per_step = n / (2 * steps)
    return summary["step_times"][WARMUP:], per_step


def span_cost_s(n=20000) -> float:
    """Seconds one recorded event costs on this rank (wall clock; CPU)."""
    import time

    from paddle_hybrid.dygraph.timeline.recorder import Recorder

    rec = Recorder()
    rec.begin_step(0)
    t0 = time.perf_counter()
    for i in range(n):
        with rec.span("forward", "F", micro=i, chunk=None):
            pass
    rec.end_step()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must be > {WARMUP} (the warm-up steps are not timed)")
    times = {label: [] for label, _ in CONFIGS}
    events_per_step = None
    for _ in range(args.rounds):
        for label, extra in CONFIGS:
            t, n = run(extra, args.steps, args.timeout)
            times[label] += t
            events_per_step = n or events_per_step
    rows = {label: {"median_step_s": statistics.median(t), "steps_timed": len(t)} for label, t in times.items()}
    base, rec = (rows[label]["median_step_s"] for label, _ in CONFIGS)
    overhead = rec / base - 1.0
    cost = span_cost_s()
    estimate = cost * events_per_step / base
    out = {"config": vars(args), "rows": rows, "overhead": overhead, "target": 0.03, "met": overhead <= 0.03,
           "span_cost_us": 1e6 * cost, "events_per_rank_step": events_per_step, "estimated_overhead": estimate}
    print(f"timeline recording, examples/gpt_pp.py PP=2 defaults, medians over {args.rounds} round(s)")
    for label, r in rows.items():
        print(f"  {label:22s} {1000 * r['median_step_s']:8.1f} ms/step ({r['steps_timed']} steps)")
    print(f"overhead {100 * overhead:+.1f}% (target <= 3%: {'met' if out['met'] else 'NOT met'}); recorder cost "
          f"{1e6 * cost:.1f} us/event x {events_per_step:.0f} events/step = {100 * estimate:.3f}% of a step")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "timeline.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
