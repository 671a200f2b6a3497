"""Gather a layout from every rank of a group and name the first difference.

Both the static fused all_reduce (gradient groups of a program) and the dygraph gradient
buckets must be laid out the same on every rank, or the fused collectives pair up the
wrong bytes.  Each describes its layout as a list of entries (JSON-serialisable: numbers,
strings, lists); this module gathers the lists through the job's store
(:mod:`paddle_hybrid.common.exchange`: plain JSON, a deadline that names the missing ranks, no
collective left blocked) and raises naming the first entry that differs and the two ranks.
"""
from __future__ import annotations


from ..config import DEFAULT_TIMEOUT
from .exchange import exchange

__all__ = ["LayoutMismatchError", "first_difference", "gather_and_compare", "DEFAULT_TIMEOUT"]


class LayoutMismatchError(RuntimeError):
    """Ranks built different layouts; running would hang or mix up bytes."""


def first_difference(a: list, b: list):
    """``(index, entry_a, entry_b)`` of the first differing entry (None past an end), or None."""
    for k in range(max(len(a), len(b))):
        x = a[k] if k < len(a) else None
        y = b[k] if k < len(b) else None
        if x != y:
            return k, x, y
    return None


def _group_ranks(group) -> list:
    import paddle.distributed as dist

    if group is not None and getattr(group, "ranks", None):
        return list(group.ranks)
    return list(range(dist.get_world_size()))


def gather_and_compare(entries: list, *, group=None, timeout: float = DEFAULT_TIMEOUT,
                       setting: str = "PADDLE_HYBRID_TIMEOUT", what: str, describe=repr, fix: str,
                       error=LayoutMismatchError) -> list:
    """Gather ``entries`` from every rank of ``group`` (None: every rank of the job) and compare
    them with its first rank's.

    ``what`` names the layout in messages ("gradient-bucket layout"), ``describe(entry)`` renders
    one entry (as JSON gives it back: lists for tuples), ``fix`` says what the user must change;
    ``error`` is the exception class raised.  ``timeout`` is the deadline, ``setting`` its name
    for the message of :class:`~paddle_hybrid.common.exchange.ExchangeTimeout`.  Returns the
    gathered lists, in the order of the group's ranks.
    """
    import paddle.distributed as dist

    ranks = _group_ranks(group)
    by_rank = exchange(list(entries), topic=what, ranks=ranks, rank=dist.get_rank(), timeout=timeout,
                       setting=setting)
    gathered = [by_rank[r] for r in ranks]
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
