"""The exit code of ``python -m paddle_hybrid.launch``: the code of the worker that failed first.

When a worker fails, Paddle's launcher stops the others (SIGTERM) and exits with the code of the
first worker *in rank order* whose code is not 0 (``Pod.exit_code``).  Two things make that the
wrong worker.  A lower rank that was still running has the -15 of the stop, so the script's own
code is lost.  And a lower rank whose collective failed *because* a peer died (gloo's "Connection
reset by peer", a TIMEOUT) exits a few milliseconds after that peer, inside the same poll of the
launcher (Paddle's looks once a second; the plugin's every 50 ms, :func:`_poll_sooner`), so Paddle
names the victim and shows its log.

**The rule.**  The root cause is, among the workers that failed on their own, the one that failed
first in time; a worker whose reason is a peer's failure (:func:`is_collateral`: a gloo
timeout, a connection reset or closed by the peer, ...) loses to any worker that failed for
another reason, whatever the clocks say.  Rank order only breaks ties.  A worker failed "on its
own" when its code is not 0 and it had ended, or recorded its failure, before the launcher began
to stop the pod; a worker the launcher stopped never is the cause.  When no worker failed on its
own (the user pressed Ctrl-C, a peer node failed), Paddle's rule stands and nothing is printed.

**A rank that hung.**  A worker that does not fail but stops (a deadlock, an endless loop, a
wait on something that never comes) is found by its peers: their next collective times out at
``PADDLE_HYBRID_TIMEOUT`` and its ``GlooTimeoutError`` names the rank it waited for
(:mod:`paddle_hybrid.gloo.errors`).  When the first failure is such a timeout and the
rank it waited for is still running when the launcher begins to stop the pod, that rank is the
root cause ("rank 1 hung; the job exits with code 1"), not the peer that timed out.  Before the
stop the launcher sends it ``SIGUSR2``, on which the bootstrap's :mod:`faulthandler` writes every
thread's Python stack into its log, and waits :data:`STACK_WAIT` seconds; the report shows that
log's tail, so the stack where it hung.  The bound is the deadline the user set, nothing of its
own: a hang in which no rank waits on another (every rank stuck) is not found.

**When each worker failed** comes from two sources:

* the worker's own record: the bootstrap (:mod:`.bootstrap`) writes the time and a one-line
  reason of an uncaught exception or a non-zero ``sys.exit`` into a per-launch temporary
  directory that this module creates, names in ``PADDLE_HYBRID_LAUNCH_RECORDS`` and removes;
* the exit time of every worker process, taken by one watcher thread per process blocked in
  ``waitid(WEXITED | WNOWAIT)``: it wakes when the process ends but leaves it a zombie, so
  Paddle's ``Popen.poll()`` still reaps it and gets its code, and Paddle's ``killpg`` of a
  process it still sees alive cannot hit a pid that a watcher already reaped.  It covers workers
  that die without Python's unwinding (``os._exit``, a signal, a C++ abort).

A record's time counts before its worker's exit time: tearing down a Python that loaded Paddle
takes long enough for a peer to fail in between.

**What the user sees.**  After Paddle's output, on stderr, one block::

    paddle_hybrid.launch: root cause: rank 1 exited with code 3 at 2026-11-25 10:00:00.123 (no Python ...
    paddle_hybrid.launch: also failed: rank 0 (code 1, +12 ms): RuntimeError: [...] Connection reset by peer
    paddle_hybrid.launch: last 30 lines of log/workerlog.1 (rank 1):
    ...
    paddle_hybrid.launch: end of the log of rank 1

and the launcher exits with the root cause's code.

Four members of Paddle's ``Pod`` are replaced, in the launcher's process only, through a
:class:`~paddle_hybrid.registry.patching.Patcher` that :func:`root_cause_exit_code` reverts on the way out
(also the environment variable and the directory):

* ``deploy``: forget what an earlier deploy saw (an elastic restart deploys the pod again), run
  Paddle's, start the exit watchers;
* ``stop``: at the first stop after a deploy, note the time and the workers that have failed
  (before any signal is sent);
* the ``exit_code`` property: the root cause's code, else Paddle's;
* ``watch``: the same, looking at the workers every 50 ms instead of every second (a job ends
  half a second sooner on average).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from ..registry.patching import Patcher, describe_versions, version_supported
from . import bootstrap

__all__ = ["VERIFIED_PADDLE", "TAIL_LINES", "RootCause", "WorkerEnd", "root_cause_exit_code", "own_failures",
           "is_collateral", "root_cause", "note_exit", "watch_exit", "format_root_cause", "waited_for",
           "dump_stacks_of_the_waited_for"]

# Paddle versions whose Pod.stop / deploy / exit_code and Container._proc._proc (the worker's
# Popen) were read and tested.
VERIFIED_PADDLE = ("3.2.", "3.3.")
TAIL_LINES = 30

_STATE = "_ph_root_cause"

# A reason that says a peer went away or did not answer: gloo's transport errors and timeouts
# ("TIMEOUT self_rank = 0 pair_rank = 1", "Timed out waiting 1800000ms for recv", "Read error
# ...: Connection reset by peer", "Connection closed by peer"), a broken pipe or socket.
_COLLATERAL = re.compile(
    r"\btime[ds]? ?out\b|connection (?:reset|closed|refused|aborted)|closed by peer|broken pipe|socket closed"
    r"|remote process exited",
    re.IGNORECASE)


def is_collateral(reason: str | None) -> bool:
    """Whether a worker's recorded reason says it failed because a peer had gone (its
    collective timed out, or the connection was reset or closed by the peer)."""
    return bool(reason) and _COLLATERAL.search(reason) is not None


@dataclasses.dataclass
class WorkerEnd:
    """How one worker of the pod ended, as far as the launcher knows."""

    index: int                      # its place in the pod (Paddle's workerlog.<index>)
    rank: int                       # its global rank (PADDLE_TRAINER_ID)
    code: int | None                # exit code, None while running
    own: bool                       # failed on its own, not stopped by the launcher
    exit_time: float | None = None  # when its process ended (the watcher)
    record_time: float | None = None  # when it recorded its failure (the bootstrap)
    reason: str | None = None
    log: str | None = None
    log_offset: int = 0
    waited: list = dataclasses.field(default_factory=list)  # ranks its timeout waited for (its record)

    @property
    def time(self) -> float | None:
        return self.record_time if self.record_time is not None else self.exit_time


@dataclasses.dataclass
class RootCause:
    rank: int
    code: int
    time: float | None
    reason: str | None
    log: str | None = None
    log_offset: int = 0             # where this launch's part of an appended log begins
    also_failed: list = dataclasses.field(default_factory=list)  # the other own failures (WorkerEnd)
    hung: bool = False              # a rank still running that its peers timed out waiting for


# "... waiting for rank 3, which did not reach it" / "waiting for ranks [2, 3]: no sign ..." (gloo_errors)
_WAITED_FOR = re.compile(r"timed out .*?waiting for (?:one of )?ranks? \[?([\d, ]+)\]?")


def waited_for(reason: str | None) -> list[int]:
    """The ranks a worker's timeout says it waited for (``GlooTimeoutError``'s wording), or []."""
    found = _WAITED_FOR.search(reason or "")
    return [int(r) for r in found.group(1).replace(",", " ").split()] if found else []


def root_cause(ends: list[WorkerEnd], hung: dict | None = None) -> RootCause | None:
    """The rule of the module docstring over the workers' ends; None: none failed on its own.
    ``hung``: global rank -> :class:`WorkerEnd` of the workers still running when the launcher
    began to stop the pod; when the first failure is a timeout waiting for one of them, that
    rank, which hung, is the root cause."""
    own = [end for end in ends if end.own and end.code not in (0, None)]
    if not own:
        return None

    def order(end):
        return (is_collateral(end.reason), end.time if end.time is not None else math.inf, end.index)

    own.sort(key=order)
    first = own[0]
    stuck = [r for r in (first.waited or waited_for(first.reason)) if r in (hung or {})]
    if stuck:
        end = hung[stuck[0]]
        reason = (f"hung: still running when rank {first.rank} timed out waiting for it; its Python stack is at the "
                  f"end of its log ({first.reason})")
        return RootCause(rank=end.rank, code=first.code, time=first.time, reason=reason, log=end.log,
                         log_offset=end.log_offset, also_failed=own, hung=True)
    return RootCause(rank=first.rank, code=first.code, time=first.time, reason=first.reason, log=first.log,
                     log_offset=first.log_offset, also_failed=own[1:])


# -- the launcher's view of its workers ---------------------------------------------------

class _PodState:
    """What the patched ``Pod`` methods note about one deploy of one pod."""

    def __init__(self):
        self.lock = threading.Lock()
        self.exit_times: dict[int, float] = {}  # id(container) -> exit time
        self.stopped_at: float | None = None
        self.failed_at_stop: list = []
        self.running_at_stop: list = []  # containers still running at the first stop

    def note_exit(self, container, when: float) -> None:
        with self.lock:
            self.exit_times.setdefault(id(container), when)


def _state(pod) -> _PodState:
    state = pod.__dict__.get(_STATE)
    if state is None:
        state = _PodState()
        setattr(pod, _STATE, state)
    return state


def note_exit(pod, container, when: float) -> None:
    """Note that ``container``'s process ended at ``when`` (the first note counts)."""
    _state(pod).note_exit(container, when)


def _process(container):
    """The worker's ``Popen``-like object, as Paddle's Container holds it (``_proc._proc``)."""
    return getattr(getattr(container, "_proc", None), "_proc", None)


def watch_exit(popen: subprocess.Popen, on_exit) -> bool:
    """Call ``on_exit(time.time())`` from a daemon thread as soon as ``popen``'s process ends,
    without reaping it (``Popen`` still does; see the module docstring).  False where
    ``waitid``/``WNOWAIT`` are missing (not Linux or a BSD): no exit times there."""
    waitid, nowait = getattr(os, "waitid", None), getattr(os, "WNOWAIT", None)
    if waitid is None or nowait is None:
        return False
    pid = popen.pid

    def watch():
        try:
            waitid(os.P_PID, pid, os.WEXITED | nowait)
        except ChildProcessError:
            pass  # reaped already by Popen.poll(), which runs when the process has just ended
        except OSError:
            return
        on_exit(time.time())

    threading.Thread(target=watch, name=f"paddle_hybrid.launch: exit of {pid}", daemon=True).start()
    return True


def _global_rank(container, index: int) -> int:
    try:
        return int(getattr(container, "env", {}).get("PADDLE_TRAINER_ID", index))
    except (TypeError, ValueError):
        return index


def own_failures(pod) -> list:
    """The pod's workers that have failed (exited, code not 0), in rank order; Paddle's own
    ``Pod.failed_container`` says which (a worker never started is not one)."""
    return list(pod.failed_container())


def worker_ends(pod, records: dict) -> list[WorkerEnd]:
    """Each worker's end, from Paddle's containers, the watchers' exit times and the records."""
    state = _state(pod)
    ends = []
    for index, container in enumerate(pod.containers):
        code = container.exit_code
        record = records.get(getattr(_process(container), "pid", None)) or {}
        if code is not None and code < 0 and isinstance(record.get("code"), int) and record["code"] != 0:
            # it recorded its failure and the status it was exiting with, then a signal (the
            # launcher's stop, while its interpreter tore down) ended it: the status it chose counts
            code = record["code"]
        end = WorkerEnd(index=index, rank=_global_rank(container, index), code=code, own=False,
                        exit_time=state.exit_times.get(id(container)), record_time=record.get("time"),
                        reason=record.get("reason"), log=getattr(container, "outfile", None),
                        log_offset=getattr(container, "_log_start_offset", 0) or 0,
                        waited=list(record.get("waited_for") or []))
        if code not in (0, None):
            end.own = (state.stopped_at is None
                       or any(c is container for c in state.failed_at_stop)
                       or (end.time is not None and end.time < state.stopped_at))
        ends.append(end)
    return ends


# -- the report ---------------------------------------------------------------------------

def _clock(when: float | None) -> str:
    if when is None:
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + f".{int(when % 1 * 1000):03d}"


def _tail(path: str, offset: int, lines: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        start = offset if 0 <= offset <= size else 0
        f.seek(max(start, size - 256 * 1024))  # enough for 30 lines of any sane log
        text = f.read().decode("utf-8", errors="replace")
    return text.splitlines()[-lines:]


def format_root_cause(cause: RootCause, lines: int = TAIL_LINES) -> str:
    """The block printed after Paddle's output."""
    head = "paddle_hybrid.launch:"
    reason = cause.reason or "no Python exception recorded"
    how = "hung; the job exits" if cause.hung else "exited"
    out = [f"{head} root cause: rank {cause.rank} {how} with code {cause.code} at {_clock(cause.time)} ({reason})"]
    for end in cause.also_failed:
        delay = ""
        if end.time is not None and cause.time is not None:
            delay = f", {(end.time - cause.time) * 1000:+.0f} ms"
        out.append(f"{head} also failed: rank {end.rank} (code {end.code}{delay}): "
                   f"{end.reason or 'no Python exception recorded'}")
    if cause.log:
        try:
            tail = _tail(cause.log, cause.log_offset, lines)
        except OSError as exc:
            out.append(f"{head} cannot read the log of rank {cause.rank}, {cause.log}: {exc}")
        else:
            out.append(f"{head} last {len(tail)} lines of {cause.log} (rank {cause.rank}):")
            out.extend(tail)
            out.append(f"{head} end of the log of rank {cause.rank}")
    return "\n".join(out) + "\n"


# -- the patches --------------------------------------------------------------------------

class Launch:
    """One launch: the workers' record directory and the root cause the pod last reported."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self.decision: RootCause | None = None

    def records(self) -> dict:
        return bootstrap.read_records(self.directory) if self.directory else {}

    def decide(self, pod) -> RootCause | None:
        ends = worker_ends(pod, self.records())
        running = _state(pod).running_at_stop
        hung = {end.rank: end for end, c in zip(ends, pod.containers) if any(c is r for r in running)}
        self.decision = root_cause(ends, hung)
        return self.decision

    def forget_records(self) -> None:
        if self.directory:
            for name in os.listdir(self.directory):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.directory, name))


STACK_WAIT = 1.0  # seconds given to a hung worker to write its stack before the stop


def _runs_the_bootstrap(popen) -> bool:
    """Whether the worker process runs the bootstrap (which handles the stack signal; for any
    other program the signal's default action would end it)."""
    try:
        with open(f"/proc/{popen.pid}/cmdline", "rb") as f:
            return os.path.basename(bootstrap.__file__).encode() in f.read()
    except OSError:
        return False


def dump_stacks_of_the_waited_for(pod, records: dict) -> list[int]:
    """Send the stack signal to every running worker a failed worker's timeout says it waited
    for; returns their global ranks."""
    waited = set()
    for container in pod.containers:
        record = records.get(getattr(_process(container), "pid", None)) or {}
        if container.exit_code not in (0, None):
            waited.update(record.get("waited_for") or waited_for(record.get("reason")))
    asked = []
    for index, container in enumerate(pod.containers):
        popen = _process(container)
        rank = _global_rank(container, index)
        if rank in waited and container.exit_code is None and popen is not None and _runs_the_bootstrap(popen):
            with contextlib.suppress(OSError):
                popen.send_signal(bootstrap.STACK_SIGNAL)
                asked.append(rank)
    return asked


POLL_SECONDS = 0.05  # how often the launcher looks at its workers (Paddle's Pod.watch: every second)


def _poll_sooner(patcher: Patcher, pod_class) -> None:
    """Paddle's ``Pod.watch`` sleeps a second between looks at the workers, so a job is reported
    finished (or failed) half a second late on average; the plugin's launcher looks every
    :data:`POLL_SECONDS`.  The rule of this module reads exit times and records, not poll times,
    so a quicker look changes only when the launcher notices."""
    import inspect

    original_watch = patcher.require(pod_class, "watch", "paddle.distributed.launch.job.pod.Pod")
    if "interval" not in inspect.signature(original_watch).parameters:
        return
    patcher.set(pod_class, "watch", functools.partialmethod(original_watch, interval=POLL_SECONDS))


def _install(patcher: Patcher, pod_class, launch: Launch) -> None:
    _poll_sooner(patcher, pod_class)
    original_stop = patcher.require(pod_class, "stop", "paddle.distributed.launch.job.pod.Pod")
    original_deploy = patcher.require(pod_class, "deploy", "paddle.distributed.launch.job.pod.Pod")
    original_exit_code = pod_class.__dict__.get("exit_code")
    if not isinstance(original_exit_code, property):
        raise TypeError("paddle.distributed.launch.job.pod.Pod.exit_code is not a property")

    def stop(self, *args, **kwargs):
        # Only the first stop after a deploy sees the workers as they ended on their own.
        state = _state(self)
        if state.stopped_at is None:
            state.stopped_at = time.time()
            state.failed_at_stop = own_failures(self)
            state.running_at_stop = [c for c in self.containers if c.exit_code is None]
            if dump_stacks_of_the_waited_for(self, launch.records()):
                time.sleep(STACK_WAIT)
        return original_stop(self, *args, **kwargs)

    def deploy(self, *args, **kwargs):
        state = _PodState()  # the watchers of an earlier deploy keep noting into theirs
        setattr(self, _STATE, state)
        launch.forget_records()
        result = original_deploy(self, *args, **kwargs)
        for container in self.containers:
            popen = _process(container)
            if isinstance(popen, subprocess.Popen):
                watch_exit(popen, lambda when, c=container: state.note_exit(c, when))
        return result

    def exit_code(self):
        cause = launch.decide(self)
        return cause.code if cause is not None else original_exit_code.fget(self)

    patcher.set(pod_class, "stop", stop)
    patcher.set(pod_class, "deploy", deploy)
    patcher.set(pod_class, "exit_code", property(exit_code))


def _record_directory(patcher: Patcher) -> str:
    """Create the workers' record directory, name it in their environment; both undone at
    revert."""
    directory = tempfile.mkdtemp(prefix="paddle_hybrid_launch.")
    before = os.environ.get(bootstrap.RECORD_DIR)
    os.environ[bootstrap.RECORD_DIR] = directory

    def undo():
        if before is None:
            os.environ.pop(bootstrap.RECORD_DIR, None)
        else:
            os.environ[bootstrap.RECORD_DIR] = before
        shutil.rmtree(directory, ignore_errors=True)

    patcher.on_revert(undo, f"{bootstrap.RECORD_DIR} and {directory}")
    return directory


@contextlib.contextmanager
def root_cause_exit_code():
    """While inside, Paddle's launcher in this process exits with the root cause's code and
    prints the root-cause block when it leaves with ``sys.exit`` (see the module docstring).
    Yields the :class:`Launch`.  On a Paddle version this was not verified on it warns and
    leaves Paddle's rule."""
    import paddle
    from paddle.distributed.launch.job.pod import Pod

    patcher = Patcher("paddle_hybrid.launch", "python -m paddle.distributed.launch")
    launch = Launch(None)
    if version_supported(paddle.__version__, VERIFIED_PADDLE):
        try:
            launch.directory = _record_directory(patcher)
            _install(patcher, Pod, launch)
        except BaseException:
            patcher.revert()
            raise
    else:
        warnings.warn(f"paddle_hybrid.launch: Paddle {paddle.__version__} is not one the exit-code rule was verified "
                      f"on ({describe_versions(VERIFIED_PADDLE)}); the launcher exits with Paddle's code (that of "
                      "the lowest rank with a non-zero code, which may be one the launcher stopped).",
                      RuntimeWarning, stacklevel=3)
    try:
        yield launch
    except SystemExit:
        if launch.decision is not None:
            sys.stdout.flush()  # Paddle's log tails go to stdout: the block comes after them
            sys.stderr.write(format_root_cause(launch.decision))
            sys.stderr.flush()
        raise
    finally:
        patcher.revert()
