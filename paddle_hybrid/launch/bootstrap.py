"""What each worker of ``python -m paddle_hybrid.launch`` runs: ``bootstrap.py SCRIPT ARGS``.

Imports ``paddle_hybrid`` (which installs the plugin), then runs SCRIPT as plain
``python SCRIPT ARGS`` would: ``__name__ == "__main__"``, ``__file__`` = SCRIPT,
``sys.argv == [SCRIPT, *ARGS]``, the script's directory first on ``sys.path``.  ``runpy``
puts the script's module in ``sys.modules["__main__"]`` while it runs, so objects defined in it
pickle as they do under plain Python.  An exception or ``sys.exit`` in the script ends the
process as it would without the bootstrap (exit status 1 or the given code).

**The failure record.**  When the script ends with an exception or a non-zero ``sys.exit``,
the bootstrap first writes when that happened, a one-line reason (``RuntimeError: boom``,
``SystemExit: 7``) and the status it is about to exit with (1, 7) to ``<dir>/<pid>.json``, where ``<dir>`` is the directory the launcher names
in ``PADDLE_HYBRID_LAUNCH_RECORDS`` (no variable: no record).  The launcher compares these
times to find the worker that failed first (:mod:`.exit_code`), and reports the recorded status
when the launcher's stop killed the worker while its interpreter was still tearing down.  The time is taken where the
exception leaves the script, not at the process's exit: tearing down an interpreter with Paddle
loaded takes a while, and a peer's collective may fail in between.  A worker that dies without
running Python's unwinding (``os._exit``, a signal, a C++ abort) leaves no record; the launcher
knows its exit time from its own watcher.  The record is plain JSON, written to a temporary
name and renamed, so the launcher never reads half of one.

**The stack on request.**  The bootstrap registers :mod:`faulthandler` on ``SIGUSR2``
(:data:`STACK_SIGNAL`): the signal writes every thread's Python stack to the worker's stderr, its
log, and the worker goes on.  The launcher sends it to a rank its peers timed out waiting for,
before stopping the job, so the report shows where that rank hung.  A script that installs its own
``SIGUSR2`` handler replaces this one.

Run as a file, not as part of the package: this directory, which Python put first on
``sys.path``, is replaced by the script's.  The launcher imports this file as a module only
for :func:`read_records` and the record's format; it needs nothing but the standard library.
"""
import faulthandler
import json
import os
import runpy
import signal
import socket
import struct
import sys
import time

RECORD_DIR = "PADDLE_HYBRID_LAUNCH_RECORDS"
REASON_LIMIT = 300  # characters of a reason
STACK_SIGNAL = signal.SIGUSR2
STARTED_VARIABLE = "PADDLE_HYBRID_WARM_STARTED"  # set in a worker that was a waiting process


def _first_line(message: str) -> str:
    """The line of an exception message that says what happened: after Paddle's
    "Error Message Summary:" header when there is one (its C++ traceback comes first), else the
    first non-blank line."""
    lines = [line.strip() for line in message.splitlines()]
    if "Error Message Summary:" in lines:
        lines = lines[lines.index("Error Message Summary:") + 1:]
    for line in lines:
        if line and set(line) != {"-"}:
            return line
    return ""


def one_line_reason(exc: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone without a message), at most
    :data:`REASON_LIMIT` characters."""
    if isinstance(exc, SystemExit):
        message = "" if exc.code is None else str(exc.code)
    else:
        message = str(exc)
    line = _first_line(message)
    reason = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return reason if len(reason) <= REASON_LIMIT else reason[:REASON_LIMIT - 3] + "..."


def exit_status(exc: BaseException) -> int | None:
    """The status the interpreter exits with because of ``exc``: the code of ``sys.exit(int)``,
    1 for another exception or ``sys.exit("message")``; None for ``KeyboardInterrupt``, which
    ends the process by its signal."""
    if isinstance(exc, KeyboardInterrupt):
        return None
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    return 1


def is_failure(exc: BaseException) -> bool:
    """Whether the process ends with a non-zero status because of ``exc``."""
    return not (isinstance(exc, SystemExit) and exc.code in (None, 0))


def waited_for(exc: BaseException) -> list:
    """The global ranks a gloo timeout in ``exc`` or its causes waited for (the ``waited_for`` of
    the plugin's ``GlooTimeoutError``, also when the script wrapped it in an error of its own)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        ranks = getattr(exc, "waited_for", None)
        if ranks:
            return [int(r) for r in ranks]
        exc = exc.__cause__ or exc.__context__
    return []


def write_record(directory: str, pid: int, rank: int, when: float, reason: str, code: int | None = None,
                 waited: list | None = None) -> None:
    """Write the failure record of process ``pid`` (atomically: temporary name, then rename);
    ``code``: the status it is about to exit with, if known; ``waited``: the ranks a timeout
    waited for."""
    path = os.path.join(directory, f"{pid}.json")
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump({"pid": pid, "rank": rank, "time": when, "reason": reason, "code": code,
                   "waited_for": list(waited or [])}, f)
    os.replace(partial, path)


def read_records(directory: str) -> dict:
    """``{pid: record}`` of the complete records in ``directory``; unreadable ones are skipped."""
    records = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return records
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                record = json.load(f)
            records[int(record["pid"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def _record_failure(exc: BaseException, when: float) -> None:
    directory = os.environ.get(RECORD_DIR)
    if not directory or not is_failure(exc):
        return
    try:
        rank = int(os.environ.get("PADDLE_TRAINER_ID", "-1"))
        write_record(directory, os.getpid(), rank, when, one_line_reason(exc), exit_status(exc), waited_for(exc))
    except Exception:  # noqa: BLE001  (a record is a courtesy; the script's own error matters)
        pass


def _import_plugin() -> None:
    """Import the ``paddle_hybrid`` this file belongs to (also when it is not installed, e.g.
    run from a checkout), without leaving its parent directory on ``sys.path``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    try:
        import paddle_hybrid  # noqa: F401  (installs the plugin before the script's first line)
    finally:
        sys.path.remove(root)


# -- a waiting process (paddle_hybrid.launch.warm_start) ---------------------------------------

# -- framing over the socket -------------------------------------------------------------------

def send_frame(sock: socket.socket, payload: dict, fds: list | None = None) -> None:
    """One JSON message, its length first; ``fds`` travel with its first bytes (SCM_RIGHTS)."""
    data = json.dumps(payload).encode()
    frame = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [frame], fds) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def receive_frame(sock: socket.socket, maxfds: int = 0):
    """``(payload, fds)`` of the next message, or ``(None, [])`` at the end of the stream."""
    if maxfds:
        data, fds, _flags, _addr = socket.recv_fds(sock, 65536, maxfds)
    else:
        data, fds = sock.recv(65536), []
    if not data:
        return None, fds
    while len(data) < 4:
        more = sock.recv(65536)
        if not more:
            return None, fds
        data += more
    (length,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < length:
        more = sock.recv(max(65536, length - len(data)))
        if not more:
            return None, fds
        data += more
    return json.loads(data[:length]), fds


def wait_and_take_over(fd: int) -> list:
    """In ``bootstrap.py --warm FD``: import Paddle, say so, wait for a worker's command and take it
    on (environment, directory, standard output and error); its arguments (``[bootstrap, SCRIPT,
    ARGS...]``) returned.  Exits quietly when the launcher goes without sending one."""
    sock = socket.socket(fileno=fd)
    try:
        import paddle  # noqa: F401  (the point: done while the launcher imports its own)
        ready = {"ok": True, "environ": dict(os.environ)}
    except BaseException as exc:  # noqa: BLE001  (the launcher starts the worker as before; it will say why)
        ready = {"ok": False, "error": repr(exc)}
    try:
        send_frame(sock, ready)
        job, fds = receive_frame(sock, maxfds=2) if ready["ok"] else (None, [])
    except OSError:  # the launcher is gone
        job, fds = None, []
    if job is None:  # not needed, or the launcher is gone: leave quietly
        os._exit(0)
    os.environ.clear()
    os.environ.update(job["env"])
    os.environ[STARTED_VARIABLE] = "1"
    os.chdir(job["cwd"])
    for target, fd_ in zip((1, 2), fds):
        os.dup2(fd_, target)
        os.close(fd_)
    sock.close()
    return job["argv"]


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--warm":
        sys.argv = wait_and_take_over(int(sys.argv[2]))
    if len(sys.argv) < 2:
        sys.exit("usage: python -m paddle_hybrid.launch [launcher arguments] script.py [script arguments]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    # Python puts the directory of the (symlink-resolved) script first on sys.path.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    try:
        _import_plugin()
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:
        _record_failure(exc, time.time())
        raise


if __name__ == "__main__":
    main()
