"""Every gloo group waits as long as the user says: ``PluginConfig.timeout``
(``PADDLE_HYBRID_TIMEOUT``, default 600 s) instead of gloo's own 30 s.

Stock Paddle creates every CPU group with gloo's default timeout and has no setting for it
(:mod:`paddle_hybrid.gloo.context_timeout` says where it lives), so one rank pausing 40 s for a
checkpoint kills the job with a raw gloo ``TIMEOUT``.  Patch: ``_new_process_group_impl``, which
creates every dygraph group (``new_group``, and ``init_parallel_env``'s global group through the
name ``paddle.distributed.parallel`` imported), sets the timeout of each new gloo group to the
deadline, or to the ``timeout`` the caller gave ``new_group`` (Paddle takes one and passes it on to
no backend).  Groups of other backends are not touched.  Where this Paddle does not let the timeout
be set (another architecture, other symbols), nothing is patched and one warning says that gloo's
30 s stays.  Only the connection of a group's creation, inside Paddle's own call, keeps gloo's
default.
"""
from __future__ import annotations

import functools
import inspect
import threading
import warnings

from . import context_timeout as gloo_timeout

__all__ = ["apply"]

_warned: list = []
_asked = threading.local()  # .seconds: the timeout given to the new_group call in progress


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
            asked = getattr(_asked, "seconds", None)
            _set_deadline(group, milliseconds if asked is None else max(1, int(asked * 1000)))
        return group

    return _new_process_group_impl


def _make_new_group(original):
    """``new_group`` that hands a ``timeout`` its caller gave (not Paddle's default) to the group's
    creation below it."""
    signature = inspect.signature(original)
    default = signature.parameters["timeout"].default

    @functools.wraps(original)
    def new_group(*args, **kwargs):
        timeout = signature.bind(*args, **kwargs).arguments.get("timeout", default)
        if timeout is default:
            return original(*args, **kwargs)
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"paddle_hybrid: new_group(timeout=...) must be a positive datetime.timedelta, got "
                             f"{timeout!r}.")
        previous, _asked.seconds = getattr(_asked, "seconds", None), float(seconds)
        try:
            return original(*args, **kwargs)
        finally:
            _asked.seconds = previous

    return new_group


def apply(config, patcher) -> None:
    """Phases: can this Paddle's gloo timeout be set at all? then both names of the creator, then
    both names of ``new_group`` (for a caller's timeout)."""
    import paddle.distributed.collective as collective
    import paddle.distributed.parallel as parallel

    ok, why = gloo_timeout.available()
    if not ok:
        warnings.warn(f"paddle_hybrid: gloo groups keep gloo's 30 s timeout, PADDLE_HYBRID_TIMEOUT does not reach "
                      f"them here: {why}.", RuntimeWarning, stacklevel=2)
        return
    import paddle.distributed as dist

    milliseconds = int(config.timeout * 1000)
    stock = patcher.require(parallel, "_new_process_group_impl", "paddle.distributed.parallel")
    stock_new_group = patcher.require(collective, "new_group", "paddle.distributed.collective")
    if "timeout" in inspect.signature(stock_new_group).parameters:  # else there is no caller's timeout to pass on
        new_group = _make_new_group(stock_new_group)
        patcher.set(collective, "new_group", new_group)
        if getattr(dist, "new_group", None) is stock_new_group:
            patcher.set(dist, "new_group", new_group)
    patcher.set(collective, "_new_process_group_impl",
                _make_new_pg_impl(collective._new_process_group_impl, milliseconds))
    patcher.set(parallel, "_new_process_group_impl", _make_new_pg_impl(stock, milliseconds))
