"""``python -m paddle_hybrid.verify`` and the replica check, measured on 2 cores.

* **verify**: the whole command on ``examples/paddleformers_trainer.py`` (tiny LLaMA, 4 steps,
  accumulation 2, clipping 1.0) over one process, TP2, PP2, DP2 and sharding 2: wall time of the
  command and of each run (target: under 2 minutes).
* **replica check**: ``examples/gpt_pp.py`` (4 blocks, hidden 128, the default model) in DP2 and
  TP2, 12 steps, with ``PADDLE_HYBRID_CHECK_REPLICAS`` 0 (the default) and 1 (a check every step),
  side by side: the median step time of each (the first step left out) and what one check costs.

Prints a table and writes ``benchmarks/results/verify.json``.

    python benchmarks/bench_verify.py
    python benchmarks/bench_verify.py --steps 8
"""
from __future__ import annotations

import argparse
import glob
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
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(cmd, env, timeout=1800):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def measure_verify(work: str) -> dict:
    model = os.path.join(work, "tiny-llama")
    _run([sys.executable, TRAINER, "write-tiny-model", model], _env())
    verdict = os.path.join(work, "verdict.json")
    start = time.time()
    _run([sys.executable, "-m", "paddle_hybrid.verify", "--layouts", "tp2,pp2,dp2,sharding2", "--json", verdict,
          TRAINER, "--model_name_or_path", model, "--output_dir", "unused", "--device", "cpu", "--bf16", "false",
          "--fp16", "false", "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none",
          "--max_steps", "4", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
          "--max_grad_norm", "1.0", "--save_strategy", "no"], _env())
    total = time.time() - start
    with open(verdict) as f:
        result = json.load(f)
    return {"seconds": total, "runs": result["seconds"], "equal": {k: v["equal"] for k, v in result["layouts"].items()}}


def _gpt_step_time(work: str, name: str, layout: list, steps: int, check: int) -> float:
    out = os.path.join(work, name)
    _run([sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "--log_dir", out + ".log", GPT,
          *layout, "--steps", str(steps), "--out-dir", out, "--log-every", str(steps)],
         _env(PADDLE_HYBRID_CHECK_REPLICAS=check))
    [path] = glob.glob(os.path.join(out, "*.json"))
    with open(path) as f:
        times = json.load(f)["step_times"][1:]
    return statistics.median(times)


def measure_replica_check(work: str, steps: int) -> dict:
    rows = {}
    for name, layout in (("dp2", ["--pp", "1", "--dp", "2"]), ("tp2", ["--pp", "1", "--mp", "2"])):
        off = _gpt_step_time(work, f"{name}_off", layout, steps, 0)
        on = _gpt_step_time(work, f"{name}_on", layout, steps, 1)
        rows[name] = {"off": off, "on": on, "check_ms": 1e3 * (on - off), "ratio": on / off}
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    report = {"date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as work:
        report["verify"] = measure_verify(work)
        report["replica_check"] = measure_replica_check(work, args.steps)
    v = report["verify"]
    print(f"verify, tiny LLaMA Trainer, one + tp2, pp2, dp2, sharding2: {v['seconds']:.1f} s in all (target < 120 s); "
          f"runs: " + ", ".join(f"{k} {s:.1f} s" for k, s in v["runs"].items()) + f"; equal: {v['equal']}")
    print(f"\nreplica check every step, gpt_pp.py (default model), {args.steps} steps, median step time")
    print(f"{'layout':<8} {'off (ms)':>9} {'on (ms)':>9} {'a check (ms)':>13} {'on/off':>7}")
    for name, row in report["replica_check"].items():
        print(f"{name:<8} {row['off'] * 1e3:9.1f} {row['on'] * 1e3:9.1f} {row['check_ms']:13.1f} {row['ratio']:7.2f}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "verify.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
