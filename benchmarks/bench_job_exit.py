"""How often a finished four-rank job dies on its way out: the plugin's TCP store choice against
Paddle's libuv store, side by side.

The job: ``examples/paddleformers_trainer.py`` with TP2 x PP2 (4 ranks, CPU/gloo, 4 steps, a
checkpoint every 2), launched with ``python -m paddle_hybrid.launch``.  Each round starts two such
jobs at once, one per arm, so both see the same load (2 jobs x 4 ranks on the machine's cores,
like CI running two Paddle versions side by side):

* ``default``: what a user gets: the plugin's ``cpu`` component sets
  ``FLAGS_tcp_store_using_libuv`` False (``paddle_hybrid/gloo/tcp_store.py``);
* ``libuv``: ``FLAGS_tcp_store_using_libuv=1`` in the environment (the plugin keeps a user's
  setting): Paddle's default store.

A run fails when the launcher exits non-zero; the table shows its code (250: a rank's SIGABRT)
and the rank the launcher names.  Needs PaddleFormers (``PADDLE_HYBRID_EXTRAS=paddleformers``).

    python benchmarks/bench_job_exit.py --rounds 20 --out /tmp/job_exit.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
ARMS = {"default": {}, "libuv": {"FLAGS_tcp_store_using_libuv": "1"}}
TRAINER_FLAGS = ["--device", "cpu", "--bf16", "false", "--fp16", "false", "--amp_master_grad", "false",
                 "--split_param", "false", "--report_to", "none", "--max_steps", "4",
                 "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "2",
                 "--save_strategy", "steps", "--save_steps", "2",
                 "--tensor_model_parallel_size", "2", "--pipeline_model_parallel_size", "2"]
ROOT_CAUSE = re.compile(r"root cause: rank (\d+) exited with code (-?\d+)")


def _env(extra: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env.pop("FLAGS_tcp_store_using_libuv", None)  # the arm decides
    env.update(extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(work: str, arm: str, model: str, index: int) -> subprocess.Popen:
    out = os.path.join(work, f"{arm}{index}")
    cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "4", "--log_dir", out + ".log",
           SCRIPT, "--model_name_or_path", model, "--output_dir", out, *TRAINER_FLAGS]
    return subprocess.Popen(cmd, env=_env(ARMS[arm]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", help="write the runs and the summary as JSON here")
    args = parser.parse_args()

    import paddle

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_job_exit.") as work:
        model = os.path.join(work, "tiny-llama")
        subprocess.run([sys.executable, SCRIPT, "write-tiny-model", model], env=_env({}), check=True,
                       capture_output=True)
        print(f"{'round':>5}  {'arm':>7}  {'rc':>4}  root cause")
        for i in range(args.rounds):
            jobs = {arm: _start(work, arm, model, i) for arm in ARMS}
            for arm, job in jobs.items():
                output, _ = job.communicate(timeout=600)
                cause = ROOT_CAUSE.search(output)
                row = {"round": i + 1, "arm": arm, "rc": job.returncode,
                       "root_cause": f"rank {cause[1]}, code {cause[2]}" if cause else None}
                rows.append(row)
                print(f"{i + 1:>5}  {arm:>7}  {row['rc']:>4}  {row['root_cause'] or '-'}", flush=True)

    summary = {arm: {"runs": sum(r["arm"] == arm for r in rows),
                     "failed": sum(r["arm"] == arm and r["rc"] != 0 for r in rows)} for arm in ARMS}
    print()
    for arm, s in summary.items():
        print(f"{arm:>7}: {s['failed']} of {s['runs']} finished jobs exited non-zero")
    if args.out:
        report = {"benchmark": "job_exit", "date": time.strftime("%Y-%m-%d"), "paddle": paddle.__version__,
                  "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
                  "summary": summary, "runs": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
