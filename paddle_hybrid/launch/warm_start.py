"""Workers that import Paddle while the launcher does: the launcher's second of start-up overlaps
the workers' own.

Why: ``python -m paddle_hybrid.launch`` must import Paddle before Paddle's launcher can start a
worker (0.8 s here), and each worker then imports Paddle again (another 0.8 s) before its first
line; a 2-process job reached its first step 1.5x later than one process.

What: at the launcher's first line, before it imports Paddle, one Python per local worker starts
(``bootstrap.py --warm``) and imports Paddle, then waits.  When Paddle's launcher starts a worker,
the command it would run (``python -u bootstrap.py SCRIPT ARGS``) is handed to a waiting process
instead: its arguments, environment and directory, and the log file's descriptors (over a Unix
socket); it takes them on and runs the bootstrap as the started command would.  That process is a
child of the launcher like any worker: Paddle's launcher watches, signals and stops it by its pid
and process group, and the root-cause records carry that pid.

When a waiting process is *not* used (the command is started as before):

* the environment Paddle gives the worker differs from the waiting process's own (after its
  ``import paddle``) in anything but the rank's variables Paddle's launcher adds (``PADDLE_*``
  other than those Paddle reads at import, ``POD_*``): Paddle reads ``FLAGS_*``, ``OMP_*``,
  ``CUDA_*`` and the rest when it is imported, so such a process is not the one asked for;
* the command is not the bootstrap of this interpreter, Paddle asks for a shell or another
  ``preexec_fn`` than a new session, the waiting process failed to import Paddle or died;
* the installed Paddle is not the CPU wheel (:func:`cpu_wheel`; the device rule: never run on an
  accelerator build), or not a version its hook was checked on (:data:`VERIFIED_PADDLE`);
* the launcher could not tell the local worker count before importing Paddle (no
  ``--nproc_per_node`` nor ``PADDLE_NPROC_PER_NODE``), the job restarts itself
  (``--max_restart``: each attempt is a launcher of its own), it spans nodes (``--nnodes`` other
  than 1, ``--master``), or ``PADDLE_HYBRID_WARM_START=0`` (``PluginConfig.warm_start``).

Every waiting process not used is stopped when the launcher leaves; one whose launcher died reads
the end of its socket and exits.  Workers started this way have ``PADDLE_HYBRID_WARM_STARTED=1``.

This module imports only the standard library: it runs before Paddle is imported.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

from .bootstrap import STARTED_VARIABLE, receive_frame, send_frame

__all__ = ["WarmPool", "start_early", "handing_over", "POOL", "may_differ", "incompatible", "early_worker_count",
           "STARTED_VARIABLE", "cpu_wheel", "VERIFIED_PADDLE"]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
VERIFIED_PADDLE = ("3.2.", "3.3.")  # the Paddle whose launcher's process_context this was checked on
# Variables Paddle reads while it is imported although they start with PADDLE_ (module constants).
READ_AT_IMPORT = frozenset({"PADDLE_P2P_SYNC_SEND", "PADDLE_USE_FOUR_DIRECTIONS_P2P"})

POOL: "WarmPool | None" = None
"""The launcher process's pool, made by :func:`start_early` (None: none)."""


# -- which worker may take a waiting process ---------------------------------------------------

def may_differ(name: str) -> bool:
    """A variable a worker's environment may have other than the waiting process's: the rank's
    variables Paddle's launcher adds, which Paddle reads when asked, not at import."""
    return (name.startswith("PADDLE_") and name not in READ_AT_IMPORT) or name.startswith("POD_")


def incompatible(wanted: dict, warm: dict) -> list:
    """The variables that make a waiting process (environment ``warm``) not the one a worker with
    environment ``wanted`` would be; empty when it is."""
    names = set(wanted) | set(warm)
    return sorted(n for n in names if wanted.get(n) != warm.get(n) and not may_differ(n))


class _Waiting:
    """One waiting process and the launcher's end of its socket."""

    def __init__(self, process: subprocess.Popen, sock: socket.socket):
        self.process, self.sock, self.environ = process, sock, None

    def ready(self, timeout: float) -> bool:
        """Phase: wait for its "Paddle imported" message (its environment after the import)."""
        if self.environ is not None:
            return True
        try:
            self.sock.settimeout(timeout)
            message, _ = receive_frame(self.sock)
        except OSError:
            return False
        finally:
            self.sock.settimeout(None)
        if not message or not message.get("ok"):
            return False
        self.environ = message["environ"]
        return True

    def stop(self) -> None:
        self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class WarmPool:
    """``count`` processes that import Paddle under ``environ`` and wait for a worker's command."""

    def __init__(self, count: int, environ: dict, ready_timeout: float, executable: str = sys.executable):
        self.executable, self.waiting, self.used, self.ready_timeout = executable, [], 0, ready_timeout
        for _ in range(count):
            mine, theirs = socket.socketpair()
            process = subprocess.Popen([executable, "-u", BOOTSTRAP, "--warm", str(theirs.fileno())],
                                       env=environ, pass_fds=[theirs.fileno()], start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            theirs.close()
            self.waiting.append(_Waiting(process, mine))

    def take(self, cmd, env, stdout, stderr, preexec_fn=None, shell=False):
        """Phases: is this the bootstrap command of a worker a waiting process can be; is one
        ready (it may still be importing Paddle); is its environment the worker's
        (:func:`incompatible`); then hand the command over.  The waiting process as a started
        worker (its ``Popen``), or None: start the command as before."""
        if shell or preexec_fn not in (None, os.setsid) or list(cmd[:3]) != [self.executable, "-u", BOOTSTRAP]:
            self.close()  # this launch starts something else: nothing will use them
            return None
        while self.waiting:
            candidate = self.waiting.pop(0)
            if candidate.process.poll() is None and candidate.ready(self.ready_timeout):
                break
            candidate.stop()
        else:
            return None
        if incompatible(dict(env), candidate.environ):
            candidate.stop()
            self.close()  # the others were made alike: none would do
            return None
        try:
            send_frame(candidate.sock, {"argv": list(cmd[2:]), "env": dict(env), "cwd": os.getcwd()},
                       [_fileno(stdout, 1), _fileno(stderr, 2)])
        except OSError:
            candidate.stop()
            return None
        candidate.sock.close()
        self.used += 1
        return candidate.process

    def close(self) -> None:
        """Stop every process still waiting."""
        while self.waiting:
            self.waiting.pop().stop()


def _fileno(stream, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


# -- the launcher's first line -----------------------------------------------------------------

def _option(argv: list, name: str):
    """The value of ``--name V`` / ``--name=V`` in the launcher's own arguments (before the
    script: the first ``.py`` argument), or None."""
    for i, token in enumerate(argv):
        if token.endswith(".py") and not token.startswith("-"):
            break
        if token == name and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return None


def cpu_wheel() -> bool:
    """Paddle's CPU wheel is the one installed (read from its package metadata, without importing
    it): the only build the warm start has run on, so the only one it starts on."""
    from importlib import metadata

    def installed(name: str) -> bool:
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            return False

    return installed("paddlepaddle") and not any(installed(f"paddlepaddle-{kind}") for kind in ("gpu", "xpu", "dcu"))


def early_worker_count(argv: list, environ) -> int | None:
    """How many workers this node will start, when the arguments say it without Paddle's parser
    and the job is one launcher on one node; else None (no waiting processes).  None also where
    descriptors cannot be handed over a Unix socket (not POSIX)."""
    if os.name != "posix" or not hasattr(socket, "send_fds"):
        return None
    if any(_option(argv, flag) is not None for flag in ("--max_restart", "--master")):
        return None
    nnodes = environ.get("PADDLE_NNODES") or _option(argv, "--nnodes")
    if nnodes not in (None, "1"):
        return None
    count = environ.get("PADDLE_NPROC_PER_NODE") or _option(argv, "--nproc_per_node")
    try:
        return int(count) if count is not None and int(count) >= 1 else None
    except ValueError:
        return None


def start_early(count: int, environ: dict, ready_timeout: float) -> None:
    """At the launcher's first line: start ``count`` waiting processes under the environment the
    workers will get (``environ``, the launcher's own additions included); a hand-off waits at most
    ``ready_timeout`` seconds (the job's deadline) for one still importing Paddle, then starts the
    worker as before.  If they cannot be started (no process or socket left), the workers start
    as before, with a warning."""
    global POOL
    try:
        POOL = WarmPool(count, environ, ready_timeout)
    except OSError as exc:
        import warnings

        warnings.warn(f"paddle_hybrid.launch: no warm start ({exc}); the workers start as before "
                      "(PADDLE_HYBRID_WARM_START=0 silences this).", RuntimeWarning, stacklevel=2)
        POOL = None


@contextlib.contextmanager
def handing_over(pool):
    """While inside, Paddle's launcher in this process hands a worker's command to a waiting
    process of ``pool`` where :meth:`WarmPool.take` allows (its ``ProcessContext`` starts
    commands with ``subprocess.Popen``; that name is replaced in its module, reversibly, through
    the plugin's patcher).  On the way out every process still waiting is stopped."""
    if pool is None:
        yield
        return
    import warnings

    import paddle
    from paddle.distributed.launch.utils import process_context

    from ..registry.patching import Patcher, describe_versions, version_supported

    if not version_supported(paddle.__version__, VERIFIED_PADDLE):
        warnings.warn(f"paddle_hybrid.launch: no warm start on Paddle {paddle.__version__} (checked on "
                      f"{describe_versions(VERIFIED_PADDLE)}); the workers start as Paddle starts them.",
                      RuntimeWarning, stacklevel=3)
        pool.close()
        yield
        return
    patcher = Patcher("paddle_hybrid.launch", "python -m paddle.distributed.launch")
    try:
        module = patcher.require(process_context, "subprocess", "paddle.distributed.launch.utils.process_context")
        patcher.set(process_context, "subprocess", _SubprocessWithPool(module, pool))
        yield
    finally:
        patcher.revert()
        pool.close()


class _SubprocessWithPool:
    """The ``subprocess`` module as ``process_context`` sees it: ``Popen`` first offers the
    command to the pool."""

    def __init__(self, module, pool):
        self._module, self._pool = module, pool

    def Popen(self, cmd, env=None, stdout=None, stderr=None, preexec_fn=None, shell=False, **kwargs):  # noqa: N802
        if not kwargs and env is not None:
            process = self._pool.take(cmd, env, stdout, stderr, preexec_fn=preexec_fn, shell=shell)
            if process is not None:
                return process
        return self._module.Popen(cmd, env=env, stdout=stdout, stderr=stderr, preexec_fn=preexec_fn, shell=shell,
                                  **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)
