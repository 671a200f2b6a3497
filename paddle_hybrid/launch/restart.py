"""Restarts of the whole job on a node when a worker fails: ``python -m paddle_hybrid.launch
--max_restart N ...``, the loop torchrun's agent runs for ``--max-restarts``.

Why here: Paddle's launcher reads ``--max_restart`` only in its etcd-based elastic mode
(``--master etcd://...``, which needs the ``etcd3`` package); otherwise it deploys the pod once and
exits with the first failure.  A long CPU job that loses a process (the OOM killer, a preempted
runner) then stops for good.

The loop, in one screen (:func:`run_attempts`): start one plain launch of the job (this same
launcher, without the loop) as a child process; wait for it; when it fails and restarts remain,
say so and start it again; when it succeeds, or was stopped by the user (SIGINT/SIGTERM reach the
agent, which passes them on and does not restart), or no restarts remain, exit with its code.  Each
attempt is a fresh Paddle launcher: a new rendezvous, new worker processes, and the root cause of
its failure printed by that launcher (:mod:`.exit_code`).  Paddle's ``--log_dir`` files of a
failed attempt are moved to ``<log_dir>/attempt_<k>/`` so the next attempt cannot overwrite them.

Every worker of attempt ``k`` (0 the first start) finds ``PADDLE_HYBRID_RESTART_COUNT=k`` and
``PADDLE_HYBRID_MAX_RESTARTS=N`` in its environment (torchrun's ``TORCHELASTIC_RESTART_COUNT`` and
``TORCHELASTIC_MAX_RESTARTS``).  Resuming is the script's business, as with torchrun: it saves
checkpoints and, at its start, loads the newest complete one (``docs/launch.md`` has a recipe).

Only an explicit ``--max_restart`` (or ``PADDLE_MAX_RESTART``) turns the loop on: Paddle's
default of 3 has never restarted anything outside its etcd mode, and a failing job that starts
restarting on its own would surprise everyone who relies on it stopping.  With
``--master etcd://...`` Paddle's own elastic controller keeps the flag.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["RESTART_COUNT", "MAX_RESTARTS", "ATTEMPT", "requested_restarts", "run_attempts", "keep_attempt_logs"]

RESTART_COUNT = "PADDLE_HYBRID_RESTART_COUNT"
MAX_RESTARTS = "PADDLE_HYBRID_MAX_RESTARTS"
ATTEMPT = "PADDLE_HYBRID_LAUNCH_ATTEMPT"  # set in a launch the loop started: it does not loop again

_HEAD = "paddle_hybrid.launch:"


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def requested_restarts(argv: list[str], args, environ) -> int | None:
    """How many restarts the user asked the loop for; None: no loop (not asked for explicitly,
    already inside an attempt, or Paddle's etcd elastic mode, which restarts by itself).
    ``argv``: the launcher's own arguments, before the training script."""
    if environ.get(ATTEMPT):
        return None
    if not (_given(argv, "--max_restart") or "PADDLE_MAX_RESTART" in environ):
        return None
    if str(getattr(args, "master", None) or "").startswith("etcd://"):
        return None
    limit = int(environ.get("PADDLE_MAX_RESTART") or args.max_restart)
    if limit < 0:
        raise ValueError(f"{_HEAD} --max_restart {limit}: the number of restarts must be 0 or more.")
    return limit


def keep_attempt_logs(log_dir: str, attempt: int, since: float) -> str | None:
    """Move the files the attempt wrote to ``log_dir`` (changed at or after ``since``: Paddle's
    worker logs, which the next attempt would overwrite) into ``log_dir/attempt_<attempt>``;
    returns that folder, or None when there was nothing to move."""
    files = [f for f in glob.glob(os.path.join(log_dir, "*")) if os.path.isfile(f) and os.path.getmtime(f) >= since]
    if not files:
        return None
    keep = os.path.join(log_dir, f"attempt_{attempt}")
    os.makedirs(keep, exist_ok=True)
    for f in files:
        shutil.move(f, os.path.join(keep, os.path.basename(f)))
    return keep


class _Stop:
    """SIGINT/SIGTERM while the loop runs: pass it on to the running attempt, restart no more."""

    def __init__(self):
        self.signal: int | None = None
        self.child: subprocess.Popen | None = None
        self._before = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame):
        self.signal = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


def run_attempts(command: list[str], max_restarts: int, log_dir: str, environ=None, log=None) -> int:
    """Run ``command`` (one plain launch of the job) until it succeeds, is stopped, or has
    failed ``max_restarts + 1`` times; returns the exit code to leave with."""
    environ = dict(os.environ if environ is None else environ)
    log = log or (lambda line: print(f"{_HEAD} {line}", file=sys.stderr, flush=True))
    with _Stop() as stop:
        for attempt in range(max_restarts + 1):
            # 1. start attempt `attempt`
            env = {**environ, ATTEMPT: "1", RESTART_COUNT: str(attempt), MAX_RESTARTS: str(max_restarts)}
            started = time.time()
            stop.child = subprocess.Popen(command, env=env)
            # 2. wait for it; a signal to the agent was passed on by the handler
            code = stop.child.wait()
            took = time.time() - started
            if code == 0:
                if attempt:
                    log(f"the job finished after {attempt} restart{'s' if attempt > 1 else ''}")
                return 0
            if stop.signal is not None:
                log(f"stopped by signal {signal.Signals(stop.signal).name}; no restart (exit code {code})")
                return code
            # 3. a failure: keep its logs, then restart while restarts remain
            kept = keep_attempt_logs(log_dir, attempt, since=started - 1.0)
            where = f"; its logs are in {kept}" if kept else ""
            if attempt == max_restarts:
                log(f"attempt {attempt + 1} failed with code {code} after {took:.1f} s{where}; no restarts left "
                    f"(--max_restart {max_restarts}), giving up")
                return code
            log(f"attempt {attempt + 1} failed with code {code} after {took:.1f} s{where}; restarting the job "
                f"(restart {attempt + 1} of {max_restarts}, {RESTART_COUNT}={attempt + 1} in every worker)")
    return code  # not reached: the loop returns on its last attempt
