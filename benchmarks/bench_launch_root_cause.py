"""How often ``python -m paddle_hybrid.launch`` names the rank that died, and how long after its death
the launcher exits.

The job (``benchmarks/dying_rank_script.py``, 2 ranks on CPU/gloo): rank 1 ends with
``os._exit(3)`` right after ``init_parallel_env()`` and a barrier; rank 0, blocked in an
``all_reduce``, fails because of it ("Connection reset by peer", or a gloo TIMEOUT) a few
milliseconds later, inside the same once-a-second poll of Paddle's launcher.  Per run: the exit
code, the rank the launcher reported as the root cause, the time from rank 1's death (its exit
time as the launcher recorded it, printed with millisecond resolution) to the launcher's exit,
and how long after rank 1 rank 0 failed.  Runs are sequential (each job uses two processes).

``--launcher paddle.distributed.launch`` runs the same job under Paddle's own launcher: it
prints no root cause, so a run "names rank 1" when it exits with rank 1's code 3.

    python benchmarks/bench_launch_root_cause.py                 # 20 runs, table on stdout
    python benchmarks/bench_launch_root_cause.py --runs 5 --out /tmp/root_cause.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import root_cause_job  # noqa: E402  (next to this file: the job, also run by tests/launch/test_root_cause.py)

EXIT_CODE = 3
ALSO = re.compile(r"also failed: rank 0 \(code (?P<code>-?\d+), (?P<ms>[+-]\d+) ms\): (?P<reason>.*)$", re.M)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def one_run(work: str, launcher: str) -> dict:
    job = root_cause_job.run(work, how="exit", exit_code=EXIT_CODE, launcher=launcher)
    row = {"rc": job.returncode, "root_cause_rank": job.rank, "root_cause_code": job.code,
           "reason": job.reason, "death_to_exit_s": None, "rank0_after_ms": None, "rank0_reason": None}
    if job.failed_at is not None:
        row["death_to_exit_s"] = round(job.exited_at - job.failed_at, 3)
    also = ALSO.search(job.output)
    if also:
        row["rank0_after_ms"], row["rank0_reason"] = int(also["ms"]), also["reason"][:160]
    if launcher == "paddle_hybrid.launch":
        row["named_rank_1"] = job.rank == 1 and job.returncode == EXIT_CODE
    else:  # Paddle's launcher: its exit code is its answer
        row["named_rank_1"] = job.returncode == EXIT_CODE
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--launcher", default="paddle_hybrid.launch",
                        choices=("paddle_hybrid.launch", "paddle.distributed.launch"))
    parser.add_argument("--out", help="write the runs and the summary as JSON here")
    args = parser.parse_args()

    import paddle

    rows = []
    print(f"{'run':>3}  {'rc':>3}  {'root cause':>10}  {'death->exit s':>13}  {'rank 0 after':>12}  rank 0's reason")
    with tempfile.TemporaryDirectory(prefix="bench_launch_root_cause.") as tmp:
        for i in range(args.runs):
            work = os.path.join(tmp, f"run{i}")
            os.makedirs(work)
            row = one_run(work, args.launcher)
            rows.append(row)
            cause = "-" if row["root_cause_rank"] is None else f"rank {row['root_cause_rank']}"
            delay = "-" if row["death_to_exit_s"] is None else f"{row['death_to_exit_s']:.3f}"
            after = "-" if row["rank0_after_ms"] is None else f"{row['rank0_after_ms']:+d} ms"
            print(f"{i + 1:>3}  {row['rc']:>3}  {cause:>10}  {delay:>13}  {after:>12}  "
                  f"{(row['rank0_reason'] or '-')[:70]}", flush=True)

    delays = [r["death_to_exit_s"] for r in rows if r["death_to_exit_s"] is not None]
    afters = [r["rank0_after_ms"] for r in rows if r["rank0_after_ms"] is not None]
    summary = {
        "runs": len(rows),
        "named_rank_1": sum(r["named_rank_1"] for r in rows),
        "median_death_to_exit_s": round(statistics.median(delays), 3) if delays else None,
        "max_death_to_exit_s": round(max(delays), 3) if delays else None,
        "rank0_failed_on_its_own": len(afters),
        "median_rank0_after_ms": statistics.median(afters) if afters else None,
    }
    print()
    print(f"{args.launcher}: named rank 1 (exit code {EXIT_CODE}) in {summary['named_rank_1']} "
          f"of {summary['runs']} runs")
    if delays:
        print(f"rank 1's death -> launcher's exit: median {summary['median_death_to_exit_s']:.3f} s, "
              f"max {summary['max_death_to_exit_s']:.3f} s")
    if afters:
        print(f"rank 0 failed on its own (collaterally) in {len(afters)} runs, a median "
              f"{summary['median_rank0_after_ms']:+g} ms after rank 1")
    if args.out:
        report = {"benchmark": "launch_root_cause", "launcher": args.launcher,
                  "date": time.strftime("%Y-%m-%d"), "paddle": paddle.__version__,
                  "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()},
                  "summary": summary, "runs": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
