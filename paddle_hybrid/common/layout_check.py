"""Gather a layout from every rank of a group and name the first difference.

Both the static fused all_reduce (gradient groups of a program) and the dygraph gradient
buckets must be laid out the same on every rank, or the fused collectives pair up the
wrong bytes.  Each describes its layout as a list of hashable entries; this module
gathers the lists (with a timeout, never a hang) and raises naming the first entry that
differs and the two ranks.

A timed-out gather leaves a thread blocked inside a collective of ``group``: the group's
next collective would pair with that stale one.  The group is therefore marked unusable
(:func:`ensure_usable` raises) instead of being silently reused.
"""
from __future__ import annotations

import threading

__all__ = ["LayoutMismatchError", "GroupUnusableError", "first_difference", "gather_and_compare",
           "ensure_usable", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 120.0
"""Seconds a layout check waits for the other ranks (``PluginConfig.static_layout_check_timeout``
defaults to it)."""

_unusable: dict = {}  # group key -> why


class LayoutMismatchError(RuntimeError):
    """Ranks built different layouts; running would hang or mix up bytes."""


class GroupUnusableError(RuntimeError):
    """A collective of this group timed out earlier; a thread may still be blocked in it."""


def _group_key(group):
    return None if group is None else tuple(getattr(group, "ranks", ()) or ()) + (getattr(group, "id", None),)


def ensure_usable(group=None) -> None:
    """Raise :class:`GroupUnusableError` if a layout check on ``group`` timed out earlier."""
    why = _unusable.get(_group_key(group))
    if why is not None:
        raise GroupUnusableError(
            f"paddle_hybrid: the process group {_describe(group)} is unusable: {why} A thread is still "
            "blocked in that collective, so the next one would pair with it. Restart the job.")


def _describe(group) -> str:
    return "default (all ranks)" if group is None else f"ranks {list(getattr(group, 'ranks', []))}"


def first_difference(a: list, b: list):
    """``(index, entry_a, entry_b)`` of the first differing entry (None past an end), or None."""
    for k in range(max(len(a), len(b))):
        x = a[k] if k < len(a) else None
        y = b[k] if k < len(b) else None
        if x != y:
            return k, x, y
    return None


def _eager_in_this_thread():
    """Dygraph for the gather, entered and left by the *calling* thread.

    Paddle's dygraph guard swaps process-global state (the default programs, the unique-name
    generator, the expected place, the C++ tracer).  Entered inside the gather thread, a timed-out
    gather would leave all of it swapped for the rest of the process; entered here, it is restored
    on the way out whatever the thread does.  Already in dygraph: nothing to swap."""
    import contextlib

    import paddle

    return contextlib.nullcontext() if paddle.in_dynamic_mode() else paddle.base.dygraph.guard()


def _all_gather_object(obj, group, timeout: float, what: str) -> list:
    import paddle.distributed as dist

    box: dict = {}

    def gather():
        try:
            out: list = []
            dist.all_gather_object(out, obj, group=group)
            box["out"] = out
        except BaseException as exc:  # re-raised in the caller's thread
            box["err"] = exc

    thread = threading.Thread(target=gather, name="ph-layout-check", daemon=True)
    with _eager_in_this_thread():
        thread.start()
        thread.join(timeout)
    if thread.is_alive():
        _unusable[_group_key(group)] = f"the {what} check timed out after {timeout:.0f} s."
        raise TimeoutError(
            f"paddle_hybrid: the {what} check did not hear from every rank of {_describe(group)} within "
            f"{timeout:.0f} s; a rank crashed or did not build its model. Check the other ranks' logs "
            "(pass a larger timeout if start-up is slow). This group is not usable any more.")
    if "err" in box:
        raise box["err"]
    return box["out"]


def gather_and_compare(entries: list, *, group=None, ranks=None, timeout: float = DEFAULT_TIMEOUT,
                       what: str, describe=repr, fix: str, error=LayoutMismatchError) -> list:
    """Gather ``entries`` from every rank of ``group`` and compare them with rank 0's.

    ``what`` names the layout in messages ("gradient-bucket layout"), ``describe(entry)`` renders
    one entry, ``fix`` says what the user must change; ``error`` is the exception class raised.
    ``ranks`` are the global ranks of the group (for messages).  Returns the gathered lists.
    """
    ensure_usable(group)
    gathered = _all_gather_object(list(entries), group, timeout, what)
    ranks = list(ranks) if ranks is not None else list(range(len(gathered)))
    reference = gathered[0]
    for r, other in enumerate(gathered[1:], start=1):
        diff = first_difference(reference, other)
        if diff is None:
            continue
        k, a, b = diff
        raise error(
            f"paddle_hybrid: the {what} differs across ranks {ranks}: entry {k} is "
            f"{describe(a) if a is not None else '(missing)'} on rank {ranks[0]} but "
            f"{describe(b) if b is not None else '(missing)'} on rank {ranks[r]}. {fix}")
    return gathered
