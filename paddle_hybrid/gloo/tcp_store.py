"""The job's TCP store on CPU: Paddle's classic server, and its connections without Nagle's delay.

1. **The classic server, not the libuv one**: a job's ranks must not abort on their way out.
   Seen now and then (``docs/benchmarks.md`` has the counts): a four-rank PaddleFormers job
   (TP2 x PP2) trained, saved, printed "Training completed", and then one rank died of SIGABRT
   (exit code -6; the launcher 250), with nothing in its log. Each core dump: the main thread in
   ``exit()`` (``_dl_fini``), the store's server thread in ``LibUVClient::readCallback`` calling
   ``abort()`` from ``libpaddle.so``, where a peer's connection had just closed. The server lives
   until the process ends (Paddle's registries of groups and comm contexts hold it), so a peer
   that exits a moment later closes its connection while this process tears down its libraries,
   and the libuv server's handling of that close aborts. Rank 0 hosts the job's store (the
   plugin adds no store of its own: :mod:`.groups` rendezvouses each group on a prefix view of
   the job's).
   Patch: ``FLAGS_tcp_store_using_libuv`` is set to False while the plugin is installed, before
   ``init_parallel_env`` makes the job's store, so it runs the classic server, whose read errors
   are caught inside its loop: the code path of the aborts is gone. Uninstalling restores the
   flag; a user who sets ``FLAGS_tcp_store_using_libuv`` in the environment keeps their choice.
   The libuv server exists for jobs of thousands of ranks; a CPU job over gloo is not one.
   Paddle 3.2 has no libuv server (nor the flag): nothing changes there. One visible difference:
   the classic server logs one INFO line when it stops ("receive shutdown event and so quit from
   MasterDaemon run loop"), at the end of the job; ``GLOG_minloglevel=1`` hides it.

2. **No Nagle delay** (``PluginConfig.store_nodelay``, ``PADDLE_HYBRID_STORE_NODELAY``, on by
   default). Paddle's store client writes a request in several small sends and sets no
   ``TCP_NODELAY`` on its connection (the server sets it on the connections it accepts), so each
   small send after the first waits for the server's delayed acknowledgement (about 40 ms on
   Linux): every request that waits for a reply takes about 44 ms on one machine, a ``get``
   88 ms. Everything the job does through the store pays it: each gloo group's rendezvous, the
   start-up agreement, the layout checks.
   Patch: the first call of ``core.create_or_get_global_tcp_store`` after install (the one that
   makes the store, unless it existed already; later calls only return it) notes the process's
   sockets before it runs; when the call made the store (new TCP sockets appeared: the client's connection and, on the
   rank hosting the server, its listening socket and the connections it accepted), each gets
   ``TCP_NODELAY`` (the server's already have it; setting it again changes nothing).
   The option changes when bytes leave, never which bytes: nothing else about the store changes.
   A store made while the plugin was installed keeps the option after ``uninstall()`` (the
   wrapper itself is removed). Linux only (the sockets are found through ``/proc/self/fd``);
   elsewhere the store is left as Paddle made it.

3. **No 3-second sleep at start-up** (with 2). A rank other than 0 connects its store client
   to rank 0's server once; if the server is not listening yet (rank 0 is still importing),
   Paddle's client sleeps 3 s before it tries again (``tcp_connect``'s fixed delay): in one
   start of a 2-rank job in four on 2 cores, every rank then waits 3 s in
   ``init_parallel_env``. The same wrapper, on such a rank, first tries the master's endpoint
   itself every 10 ms for up to those 3 s (never longer than Paddle's own first sleep, so no
   deadline of the user's is touched) and calls Paddle's once the server accepts. A try that
   connects is closed at once; the classic server drops a closed connection like any peer
   that leaves. Only with the classic server (a user who chose libuv keeps Paddle's behaviour).
"""
from __future__ import annotations

import functools
import os
import socket
import time

from .sockets import socket_fds

__all__ = ["apply", "FLAG"]

FLAG = "FLAGS_tcp_store_using_libuv"
_PADDLE_RETRY_DELAY = 3.0  # seconds: how long Paddle's store client sleeps after a refused connect


def apply(config, patcher) -> None:
    """Phases: choose the classic server; wrap the store's creation to wait for the server
    before the first connect and to turn Nagle off (unless ``config.store_nodelay`` is False)."""
    _choose_classic_server(patcher)
    from paddle.base import core

    wrapper = _make_create_or_get(core.create_or_get_global_tcp_store, nodelay=config.store_nodelay)
    patcher.set(core, "create_or_get_global_tcp_store", wrapper)


# ---------------------------------------------------------------------------
# 1. the classic server
# ---------------------------------------------------------------------------

def _choose_classic_server(patcher) -> None:
    """Phases: leave a user's own setting alone; does this Paddle have the flag? set it, undo at revert."""
    import paddle

    if FLAG in os.environ:
        return
    try:
        before = paddle.get_flags([FLAG])[FLAG]
    except (ValueError, KeyError):  # a Paddle without the libuv store: nothing to choose
        return
    if not before:
        return
    paddle.set_flags({FLAG: False})
    patcher.on_revert(lambda: paddle.set_flags({FLAG: before}), f"{FLAG}: back to {before}")


# ---------------------------------------------------------------------------
# 2. no Nagle delay on the store's connections
# ---------------------------------------------------------------------------

def _set_nodelay_on_new_sockets(before: dict) -> None:
    """Set ``TCP_NODELAY`` on every TCP socket of this process not in ``before`` (a
    :func:`~paddle_hybrid.gloo.sockets.socket_fds` result)."""
    for inode, fd in (socket_fds() or {}).items():
        if inode in before:
            continue
        try:
            sock = socket.socket(fileno=fd)  # wraps the fd without owning it: detached below
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        finally:
            sock.detach()


def _master_endpoint():
    """``(host, port)`` of rank 0's store server, as Paddle's C++ reads it (``PADDLE_MASTER``,
    else the first of ``PADDLE_TRAINER_ENDPOINTS``), or None where neither says."""
    from .reachable import store_endpoint

    return store_endpoint()


def _classic_server() -> bool:
    import paddle

    try:
        return not paddle.get_flags([FLAG])[FLAG]
    except (ValueError, KeyError):  # a Paddle without the libuv store: the classic one
        return True


def wait_for_master(budget: float = _PADDLE_RETRY_DELAY, interval: float = 0.01) -> bool:
    """On a rank other than 0, until rank 0's store server accepts a connection or ``budget``
    seconds passed (Paddle's own retry delay): try it every ``interval``.  True once it accepts."""
    if os.environ.get("PADDLE_TRAINER_ID", "0") == "0" or not _classic_server():
        return False
    endpoint = _master_endpoint()
    if endpoint is None:
        return False
    give_up = time.monotonic() + budget
    while True:
        try:
            with socket.create_connection(endpoint, timeout=max(interval, 0.1)):
                return True
        except OSError:
            if time.monotonic() >= give_up:
                return False
            time.sleep(interval)


def _make_create_or_get(original, nodelay: bool = True):
    first_call = [True]  # only the first call can make the store: later ones skip the /proc walks

    @functools.wraps(original)
    def create_or_get_global_tcp_store(*args, **kwargs):
        if not first_call[0]:
            return original(*args, **kwargs)
        first_call[0] = False
        wait_for_master()
        if not nodelay:
            return original(*args, **kwargs)
        before = socket_fds()
        store = original(*args, **kwargs)
        if before is not None:  # None: no /proc to read; a store that existed already: no new socket
            _set_nodelay_on_new_sockets(before)
        return store

    return create_or_get_global_tcp_store
