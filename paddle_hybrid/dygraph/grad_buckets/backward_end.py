"""Two moments of a backward pass that Paddle does not announce, as the buckets need them.

**A gradient is in the buffer.**  The buckets' hooks are gradient hooks (``register_hook``:
the only kind Paddle can remove again).  They run *before* Paddle adds the incoming gradient
into ``.grad``; the addition happens right after the hooks of that parameter, before the
next node of the graph runs.  So a hook only queues "parameter k accumulated" (as ``(owner, k)``
in this thread's ``pending``, :func:`state`), and the next hook on this thread, or the end of the
pass, delivers it (:func:`flush`).

**The pass is over.**  ``core.eager._add_backward_final_hook`` is no help: with re-entrant
recompute it fires at the end of the recompute's inner backward, before the outer pass has
produced the gradients in front of the block.  The component therefore wraps the two entry
points of a pass, ``paddle.Tensor.backward`` and ``paddle.autograd.backward``
(:func:`wrap_backward`); only the outermost call on a thread ends a pass (recompute calls
``paddle.autograd.backward`` from inside one).  Every bucket set that took part (one of its
hooks ran) then hears ``_backward_done()`` (or ``_backward_aborted()`` if the pass raised).

**The pass raised.**  Paddle reports an exception raised in a gradient hook as a generic
``OSError`` whose text embeds the original; a bucket set that raised in its hook hands its
exception back from ``_backward_aborted()``, and the wrapper raises that one instead (chained
to Paddle's), so the user sees e.g. the :class:`~.sync.GradSyncError` itself.

State is per thread: a pass runs its hooks on the thread that started it.
"""
from __future__ import annotations

import functools
import threading
import weakref

__all__ = ["state", "flush", "take_part", "wrap_backward", "in_backward", "end_pass"]

_local = threading.local()


def state() -> dict:
    """This thread's ``{"depth", "pending": [(owner, k)], "parts": {id: weakref(owner)}}``
    (hooks use it directly: they run for every parameter of every backward)."""
    try:
        return _local.state
    except AttributeError:  # first use on this thread
        _local.state = {"depth": 0, "pending": [], "parts": {}}
        return _local.state


def in_backward() -> bool:
    """Inside a wrapped backward call on this thread."""
    return state()["depth"] > 0


def take_part(owner) -> None:
    """``owner`` (a bucket set) will hear how the current pass ends (held weakly: a set
    nobody keeps does not need to hear it)."""
    state()["parts"].setdefault(id(owner), weakref.ref(owner))


def flush() -> None:
    """Deliver every queued "accumulated" on this thread (oldest first)."""
    s = state()
    while s["pending"]:  # a delivery never queues more; the loop is for safety
        pending, s["pending"] = s["pending"], []
        for owner, k in pending:
            owner._accumulated(k)


def end_pass(failed: bool = False):
    """The outermost backward on this thread returned (or raised, ``failed``).  Returns the
    first exception a participant's own hook raised in a failed pass (else None)."""
    s = state()
    parts = [ref() for ref in s["parts"].values()]
    s["parts"] = {}
    if failed:
        s["pending"] = []
    else:
        flush()
    first_error = None
    for owner in parts:
        if owner is None:
            continue
        if failed:
            error = owner._backward_aborted()  # every participant resets, even after an error
            first_error = first_error or error
        else:
            owner._backward_done()
    return first_error


def wrap_backward(orig):
    """``orig`` (``Tensor.backward`` or ``paddle.autograd.backward``) that ends a pass when
    the outermost call returns."""

    @functools.wraps(orig)
    def backward(*args, **kwargs):
        s = state()
        s["depth"] += 1
        try:
            out = orig(*args, **kwargs)
        except BaseException as exc:
            s["depth"] -= 1
            if s["depth"] == 0:
                hook_error = end_pass(failed=True)
                if hook_error is not None and hook_error is not exc:
                    raise hook_error from exc
            raise
        s["depth"] -= 1
        if s["depth"] == 0:
            end_pass()
        return out

    return backward
