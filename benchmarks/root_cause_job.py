"""Run ``dying_rank_script.py`` (next to this file) under ``python -m paddle_hybrid.launch`` (or
another launcher) with 2 ranks and read what the launcher reported: the job of
``benchmarks/bench_launch_root_cause.py``, which ``tests/launch/test_root_cause.py`` runs too; not
part of the package."""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks
ROOT = os.path.dirname(HERE)  # the repository, holding the package: the workers' PYTHONPATH
SCRIPT = os.path.join(HERE, "dying_rank_script.py")  # run by path, from this folder
TIMEOUT = 120

# paddle_hybrid.launch: root cause: rank N exited with code C at 2026-11-25 03:55:08.408 (reason)
# paddle_hybrid.launch: root cause: rank N hung; the job exits with code C at ... (reason)
ROOT_CAUSE = re.compile(r"paddle_hybrid\.launch: root cause: rank (?P<rank>\d+) (?P<how>exited|hung; the job exits) "
                        r"with code (?P<code>-?\d+) "
                        r"at (?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \((?P<reason>.*)\)$", re.M)


@dataclasses.dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    log_dir: str
    exited_at: float                 # when the launcher's process ended (wall clock)
    rank: int | None = None          # the reported root cause, None if none was reported
    code: int | None = None
    failed_at: float | None = None   # the time it was reported with (ms resolution)
    reason: str | None = None
    hung: bool = False               # reported as a rank that hung, not one that exited

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def log(self, rank: int) -> str:
        path = os.path.join(self.log_dir, f"workerlog.{rank}")
        return open(path, errors="replace").read() if os.path.exists(path) else ""


def run(work_dir: str, how: str = "exit", fail_rank: int = 1, exit_code: int = 3,
        launcher: str = "paddle_hybrid.launch", env: dict | None = None) -> Job:
    """One 2-rank job in ``work_dir`` (its ``--log_dir`` is ``work_dir/log``); ``env``: variables
    added to the job's environment (which has no other ``PADDLE_*`` variable)."""
    log_dir = os.path.join(work_dir, "log")
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update({"PYTHONPATH": ROOT, "GLOG_minloglevel": "2", "OMP_NUM_THREADS": "1", **extra})
    cmd = [sys.executable, "-m", launcher, "--nproc_per_node", "2", "--log_dir", log_dir, SCRIPT,
           "--how", how, "--fail-rank", str(fail_rank), "--exit-code", str(exit_code)]
    with subprocess.Popen(cmd, env=env, cwd=work_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        exited_at = time.time()
    job = Job(proc.returncode, stdout, stderr, log_dir, exited_at)
    found = ROOT_CAUSE.search(job.output)
    if found:
        job.rank, job.code, job.reason = int(found["rank"]), int(found["code"]), found["reason"]
        job.hung = found["how"] != "exited"
        job.failed_at = datetime.datetime.strptime(found["time"], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return job
