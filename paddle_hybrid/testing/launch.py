"""Run a script on N ranks with ``paddle.distributed.launch`` and collect
per-rank results.

Parent side::

    results = launch("tests/distributed/worker_ops.py", nprocs=2,
                     args=["--steps", "3"], timeout=120)
    results[0]["loss"], results[1]["loss"]

Worker side (inside the launched script)::

    from paddle_hybrid.testing import save_result
    save_result({"loss": loss_values})       # one call per rank

Every run gets its own log directory (``--log_dir``) and result directory; on
a non-zero exit, a missing result or a timeout the parent raises
:class:`LaunchError` with the tail of every ``workerlog.N``.  A timeout kills
the whole process group, so a hung collective never hangs the caller.  A launch
whose rank 0 could not bind the job's port (Paddle's launcher chose it free, and
another job took it before rank 0 bound it: seen with the two CI lanes at once) is
run once more; nothing else is retried.
"""
from __future__ import annotations

import glob
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

__all__ = ["LaunchError", "launch", "save_result", "RESULT_DIR_ENV"]

RESULT_DIR_ENV = "PADDLE_HYBRID_RESULT_DIR"
_PADDLE_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paddle_launcher.py")


class LaunchError(RuntimeError):
    """A multi-process run failed, timed out or produced no result."""


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", os.environ.get("PADDLE_RANK_IN_NODE", "0")))


def save_result(obj: Any) -> str:
    """Store this rank's result (picklable) for the launching process."""
    out_dir = os.environ.get(RESULT_DIR_ENV)
    if not out_dir:
        raise RuntimeError(
            f"paddle_hybrid.testing.save_result: {RESULT_DIR_ENV} is not set; run this script "
            "through paddle_hybrid.testing.launch()."
        )
    path = os.path.join(out_dir, f"rank{_rank()}.pkl")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)
    return path


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "<no log>"


def _logs(log_dir: str) -> str:
    parts = []
    for path in sorted(glob.glob(os.path.join(log_dir, "workerlog.*"))):
        parts.append(f"----- {os.path.basename(path)} -----\n{_tail(path)}")
    return "\n".join(parts) or "<no worker logs>"


_PORT_TAKEN = "Bind network on IP_ANY:"


def _master_port_taken(out: str, log_dir: str) -> bool:
    """Rank 0 could not bind the job's store port (taken by another process since the launcher chose it)."""
    if _PORT_TAKEN in out:
        return True
    for path in glob.glob(os.path.join(log_dir, "workerlog.*")):
        with open(path, errors="replace") as f:
            if _PORT_TAKEN in f.read():
                return True
    return False


def _run_once(cmd, run_env, timeout, script, nprocs, log_dir):
    """One launch: (exit code, launcher output); a timeout kills the process group and raises."""
    proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise LaunchError(
            f"launch: {script} on {nprocs} ranks did not finish within {timeout:.0f} s "
            f"(killed).\n{_logs(log_dir)}"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def launch(
    script: str,
    nprocs: int = 2,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    env: dict | None = None,
    keep_dir: str | None = None,
    results: bool = True,
    launcher: str = "paddle.distributed.launch",
) -> list:
    """Run ``script`` on ``nprocs`` CPU ranks over gloo; return each rank's
    :func:`save_result` object, indexed by rank (``results=False``: a script that saves none;
    only its exit status counts, and ``[]`` is returned).  ``launcher``: the launcher module
    (``"paddle_hybrid.launch"`` imports the plugin in every worker, for a script that does not)."""
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}.")
    if not os.path.exists(script):
        raise FileNotFoundError(f"launch: no such script {script!r}.")
    work = keep_dir or tempfile.mkdtemp(prefix="ph_launch_")
    os.makedirs(work, exist_ok=True)
    log_dir = os.path.join(work, "logs")
    res_dir = os.path.join(work, "results")
    os.makedirs(res_dir, exist_ok=True)
    for old in glob.glob(os.path.join(res_dir, "rank*.pkl")):
        os.remove(old)
    run_env = dict(os.environ)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    run_env.setdefault("GLOG_minloglevel", "2")
    run_env[RESULT_DIR_ENV] = res_dir
    # The launcher's children import paddle_hybrid from the same place as we do.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_env["PYTHONPATH"] = pkg_root + os.pathsep + run_env.get("PYTHONPATH", "")
    if env:
        run_env.update({k: str(v) for k, v in env.items()})
    # Paddle's launcher through a script that only shortens its poll (see paddle_launcher.py)
    entry = [_PADDLE_LAUNCHER] if launcher == "paddle.distributed.launch" else ["-m", launcher]
    cmd = [
        sys.executable,
        *entry,
        "--nproc_per_node",
        str(nprocs),
        "--log_dir",
        log_dir,
        script,
        *map(str, args),
    ]
    start = time.time()
    for attempt in (1, 2):
        returncode, out = _run_once(cmd, run_env, timeout, script, nprocs, log_dir)
        if returncode == 0 or attempt == 2 or not _master_port_taken(out, log_dir):
            break
        # Paddle's launcher picks the job's port, then rank 0 binds it later; another job on the
        # machine (the other CI lane) can take it in between. Not a result of the script: once more.
        shutil.rmtree(log_dir, ignore_errors=True)
        for old in glob.glob(os.path.join(res_dir, "rank*.pkl")):
            os.remove(old)
    elapsed = time.time() - start
    if returncode != 0:
        raise LaunchError(
            f"launch: {script} on {nprocs} ranks exited with {returncode} after "
            f"{elapsed:.1f} s.\nlauncher output (tail):\n{out[-3000:]}\n{_logs(log_dir)}"
        )
    saved = []
    for r in range(nprocs if results else 0):
        path = os.path.join(res_dir, f"rank{r}.pkl")
        if not os.path.exists(path):
            raise LaunchError(f"launch: rank {r} of {script} saved no result.\n{_logs(log_dir)}")
        with open(path, "rb") as f:
            saved.append(pickle.load(f))
    if keep_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return saved
