"""Every gloo group waits as long as the user says: ``PluginConfig.timeout``
(``PADDLE_HYBRID_TIMEOUT``, default 600 s) instead of gloo's own 30 s.

Stock Paddle creates every CPU group with gloo's default timeout and has no setting for it
(:mod:`paddle_hybrid.common.gloo_timeout` says where it lives), so one rank pausing 40 s for a
checkpoint kills the job with a raw gloo ``TIMEOUT``.  Patch: ``_new_process_group_impl``, which
creates every dygraph group (``new_group``, and ``init_parallel_env``'s global group through the
name ``paddle.distributed.parallel`` imported), sets the timeout of each new gloo group to the
deadline.  Groups of other backends are not touched.  Where this Paddle does not let the timeout
be set (another architecture, other symbols), nothing is patched and one warning says that gloo's
30 s stays.  Only the connection of a group's creation, inside Paddle's own call, keeps gloo's
default.
"""
from __future__ import annotations

import functools
import warnings

from ...common import gloo_timeout

__all__ = ["apply"]

_warned: list = []


def _set_deadline(process_group, milliseconds: int) -> None:
    try:
        gloo_timeout.set_timeout_ms(process_group, milliseconds)
    except gloo_timeout.GlooTimeoutUnavailable as exc:
        if not _warned:
            _warned.append(True)
            warnings.warn(f"paddle_hybrid: PADDLE_HYBRID_TIMEOUT cannot be applied to this gloo group ({exc}); "
                          "it keeps gloo's 30 s.", RuntimeWarning, stacklevel=3)


def _make_new_pg_impl(original, milliseconds: int):
    @functools.wraps(original)
    def _new_process_group_impl(backend, *args, **kwargs):
        group = original(backend, *args, **kwargs)
        if backend == "gloo" and group is not None:
            _set_deadline(group, milliseconds)
        return group

    return _new_process_group_impl


def apply(patcher, config) -> None:
    """Phases: can this Paddle's gloo timeout be set at all? then both names of the creator."""
    import paddle.distributed.collective as collective
    import paddle.distributed.parallel as parallel

    ok, why = gloo_timeout.available()
    if not ok:
        warnings.warn(f"paddle_hybrid: gloo groups keep gloo's 30 s timeout, PADDLE_HYBRID_TIMEOUT does not reach "
                      f"them here: {why}.", RuntimeWarning, stacklevel=2)
        return
    milliseconds = int(config.timeout * 1000)
    stock = patcher.require(parallel, "_new_process_group_impl", "paddle.distributed.parallel")
    patcher.set(collective, "_new_process_group_impl",
                _make_new_pg_impl(collective._new_process_group_impl, milliseconds))
    patcher.set(parallel, "_new_process_group_impl", _make_new_pg_impl(stock, milliseconds))
