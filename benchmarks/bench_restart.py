"""How long a job run by ``python -m paddle_hybrid.launch --max_restart 1`` takes from a rank's
death to its first resumed step, and whether it ends with the uninterrupted run's numbers.

Two jobs, 2 ranks on CPU/gloo, each run sequentially ``--runs`` times:

- ``fleet``: ``paddle_hybrid/testing/resume_script.py`` (fleet DP2, AdamW, a checkpoint every 2 of
  8 steps); rank 1 SIGKILLed at the start of a random step 3..7.  Checked against one
  uninterrupted run: the final weights bitwise.
- ``trainer``: ``examples/paddleformers_trainer.py`` (TP2, tiny LLaMA, a checkpoint every 2 of 4
  steps) through ``paddle_hybrid/testing/trainer_dies_once.py``; rank 1 SIGKILLed at the end of
  step 3; the restarted Trainer resumes from checkpoint-2.  Checked: the losses of steps 3 and 4
  against an uninterrupted run (rtol 1e-5, as the tests).  Needs PaddleFormers (Paddle >= 3.3).

"death to first resumed step": from the dying rank's wall clock just before it kills itself to
the end of the first step the restarted job completes (the latest over the ranks), so it holds
the launcher noticing the death, stopping the other rank, the new attempt's start-up (Python,
Paddle, fleet.init, the model) and the checkpoint load, plus one step.

    python benchmarks/bench_restart.py                     # 10 runs of each, table on stdout
    python benchmarks/bench_restart.py --runs 3 --jobs fleet --out /tmp/restart.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESUME_SCRIPT = os.path.join(ROOT, "paddle_hybrid", "testing", "resume_script.py")
DIES_ONCE = os.path.join(ROOT, "paddle_hybrid", "testing", "trainer_dies_once.py")
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
CPU_FLAGS = ["--device", "cpu", "--bf16", "false", "--fp16", "false", "--amp_master_grad", "false",
             "--split_param", "false", "--report_to", "none"]
sys.path.insert(0, HERE)
from bench_launch_root_cause import _cpu  # noqa: E402  (the CPU's model name, as that benchmark reports it)

TRAINER_ARGS = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
                "--per_device_train_batch_size", "2", "--save_strategy", "steps", "--save_steps", "2",
                "--tensor_model_parallel_size", "2"]


def _env(extra=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update({"PYTHONPATH": ROOT, "GLOG_minloglevel": "2", "OMP_NUM_THREADS": "1", "PADDLE_HYBRID_TIMEOUT": "60"})
    env.update(extra or {})
    return env


def _launch(work, script_args, restarts, env=None):
    cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "--log_dir",
           os.path.join(work, "log"), *(["--max_restart", str(restarts)] if restarts else []), *script_args]
    proc = subprocess.run(cmd, env=_env(env), cwd=work, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


# -- the fleet script ------------------------------------------------------------------------

def _fleet_run(work, die_at=None):
    out, ckpt = os.path.join(work, "out"), os.path.join(work, "ckpt")
    os.makedirs(out)
    args = [RESUME_SCRIPT, "--out", out, "--ckpt", ckpt, "--steps", "8"]
    if die_at is not None:
        args += ["--die-at", str(die_at), "--die-how", "kill"]
    _launch(work, args, restarts=1 if die_at is not None else 0)
    results = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1)]
    return results, out


def fleet_once(base, reference, rng) -> dict:
    work = tempfile.mkdtemp(dir=base)
    die_at = rng.randint(3, 7)
    results, out = _fleet_run(work, die_at)
    death = json.load(open(os.path.join(out, "death.json")))["time"]
    first = min(results[0]["step_end"], key=int)
    resumed = max(float(r["step_end"][first]) for r in results)
    equal = all(r["params"] == ref["params"] and r["opt"] == ref["opt"] for r, ref in zip(results, reference))
    return {"die_at": die_at, "resumed_from": results[0]["start"], "death_to_first_step_s": round(resumed - death, 2),
            "bitwise_equal": equal}


# -- the Trainer -----------------------------------------------------------------------------

def _trainer_run(work, model, name, dies):
    output_dir = os.path.join(work, name)
    script = [DIES_ONCE, TRAINER] if dies else [TRAINER]
    args = [*script, "--model_name_or_path", model, "--output_dir", output_dir, *CPU_FLAGS, *TRAINER_ARGS]
    env = {"PH_TEST_DIE_AT": "3", "PH_TEST_DIE_HOW": "step"} if dies else None
    _launch(os.path.dirname(output_dir), args, restarts=1 if dies else 0, env=env)
    return output_dir


def _progress(output_dir):
    return [json.load(open(os.path.join(output_dir, f"progress.rank{r}.json"))) for r in (0, 1)]


def trainer_once(base, model, reference) -> dict:
    work = tempfile.mkdtemp(dir=base)
    output_dir = _trainer_run(work, model, "job", dies=True)
    death = json.load(open(os.path.join(output_dir, "death.json")))["time"]
    progress = _progress(output_dir)
    first = min(progress[0]["step_end_time"], key=int)
    resumed = max(float(p["step_end_time"][first]) for p in progress)
    losses = progress[0]["loss"]
    close = all(abs(losses[s] - reference[s]) <= 1e-5 * abs(reference[s]) for s in ("3", "4"))
    return {"resumed_at_step": int(first), "death_to_first_step_s": round(resumed - death, 2),
            "losses_match": close}


def _summary(rows):
    times = [r["death_to_first_step_s"] for r in rows]
    return {"runs": len(rows), "median_s": round(statistics.median(times), 2), "min_s": min(times),
            "max_s": max(times)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--jobs", default="fleet,trainer")
    parser.add_argument("--seed", type=int, default=0, help="the random death steps of the fleet job")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_restart.json"))
    args = parser.parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    base = tempfile.mkdtemp(prefix="bench_restart.")
    report = {"cpu": _cpu(), "runs": args.runs, "jobs": {}}
    if "fleet" in jobs:
        reference, _ = _fleet_run(tempfile.mkdtemp(dir=base))
        rng = random.Random(args.seed)
        rows = [fleet_once(base, reference, rng) for _ in range(args.runs)]
        report["jobs"]["fleet"] = {"summary": _summary(rows), "rows": rows}
    if "trainer" in jobs:
        model = os.path.join(base, "tiny-llama")
        subprocess.run([sys.executable, TRAINER, "write-tiny-model", model], env=_env(), check=True,
                       capture_output=True, timeout=300)
        reference = _progress(_trainer_run(base, model, "uninterrupted", dies=False))[0]["loss"]
        rows = [trainer_once(base, model, reference) for _ in range(args.runs)]
        report["jobs"]["trainer"] = {"summary": _summary(rows), "rows": rows}
    print(f"{'job':8} {'runs':>4} {'median s':>9} {'min s':>6} {'max s':>6}  result")
    for name, job in report["jobs"].items():
        s = job["summary"]
        ok = all(r.get("bitwise_equal", r.get("losses_match")) for r in job["rows"])
        what = "bitwise equal to uninterrupted" if name == "fleet" else "steps 3-4 losses match"
        print(f"{name:8} {s['runs']:>4} {s['median_s']:>9} {s['min_s']:>6} {s['max_s']:>6}  "
              f"{what}: {'all' if ok else 'NOT all'}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
