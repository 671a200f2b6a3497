"""Every TCP store of a CPU job uses Paddle's classic server, not the libuv one: a job's ranks must
not abort on their way out.

Seen now and then (``docs/benchmarks.md`` has the counts): a four-rank PaddleFormers job (TP2 x
PP2) trained, saved, printed "Training completed", and then one rank died of SIGABRT (exit code -6;
the launcher 250), with nothing in its log. Each core dump: the main thread in ``exit()``
(``_dl_fini``), a store's server thread in ``LibUVClient::readCallback`` calling ``abort()`` from
``libpaddle.so``, where a peer's connection had just closed. A store's server lives until the
process ends (Paddle's registries of groups and comm contexts hold it), so a peer that exits a
moment later closes its connection while this process tears down its libraries, and the libuv
server's handling of that close aborts. Every rank hosting a server is exposed: rank 0, which hosts
the job's store (the plugin adds no store of its own: :mod:`.groups` rendezvouses each group on a
prefix view of the job's).

Patch: ``FLAGS_tcp_store_using_libuv`` is set to False while the plugin is installed, before
``init_parallel_env`` makes the job's store, so every store of the job runs the classic server, whose read errors are caught inside its loop: the code path of the aborts
is gone. Uninstalling restores the flag. A user who sets ``FLAGS_tcp_store_using_libuv`` in the
environment keeps their choice. The libuv server exists for jobs of thousands of ranks; a CPU job
over gloo is not one. Paddle 3.2 has no libuv server (nor the flag): nothing changes there. One
visible difference: the classic server logs one INFO line when it stops ("receive shutdown event
and so quit from MasterDaemon run loop"), at the end of the job; ``GLOG_minloglevel=1`` hides it.
"""
from __future__ import annotations

import os

__all__ = ["apply", "FLAG"]

FLAG = "FLAGS_tcp_store_using_libuv"


def apply(patcher) -> None:
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
