"""Which gradients are reduced together: the config, the groups and the layout every rank compares.

Plain data, no program edits (those are in :mod:`.rewrite`).  Gradients are grouped by dtype, in
the order backward finishes them, into groups bounded by bytes (``max_group_mb``) and by count
(``max_group_count``): a group closes at whichever limit is reached first; a gradient bigger than
the byte limit forms a group of its own.

Every rank must build identical groups in identical order, or the fused all_reduces pair up the
wrong bytes: :meth:`FusedLayout.entries` is what :mod:`paddle_hybrid.common.layout_check` compares across
ranks, :func:`layout_fingerprint` a digest of it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Sequence

from ... import ops

__all__ = ["FuseAllreduceConfig", "GradSlot", "Group", "FusedLayout", "plan_groups", "layout_fingerprint",
           "describe_entry"]


@dataclasses.dataclass(frozen=True)
class FuseAllreduceConfig:
    """How gradients are grouped and reduced.

    ``fleet`` users do not build this: the meta optimizer maps the strategy
    (``fuse_all_reduce_ops``, ``fuse_grad_size_in_MB``, ``fuse_grad_size_in_num``) onto it.
    """

    nranks: int
    """Number of data-parallel ranks; the loss gradient is scaled by ``1/nranks``."""

    max_group_mb: float = 32.0
    """Byte limit of a group in MiB (``strategy.fuse_grad_size_in_MB``, default 32)."""

    max_group_count: int = 8
    """Gradient-count limit of a group (``strategy.fuse_grad_size_in_num``, default 8)."""

    fuse: bool = True
    """False: one ``all_reduce`` per gradient (the unfused baseline)."""

    scale_loss_grad: bool = True
    """Insert the ``1/nranks`` scale of the loss gradient."""

    def __post_init__(self):
        if not isinstance(self.nranks, int) or self.nranks < 1:
            raise ValueError(f"FuseAllreduceConfig.nranks must be an int >= 1, got {self.nranks!r}.")
        if not (isinstance(self.max_group_mb, (int, float)) and self.max_group_mb > 0):
            raise ValueError(
                f"FuseAllreduceConfig.max_group_mb must be > 0, got {self.max_group_mb!r}; "
                "set strategy.fuse_grad_size_in_MB to a positive number.")
        if not isinstance(self.max_group_count, int) or self.max_group_count < 1:
            raise ValueError(
                f"FuseAllreduceConfig.max_group_count must be an int >= 1, got "
                f"{self.max_group_count!r}; set strategy.fuse_grad_size_in_num to a positive int.")

    @property
    def max_group_bytes(self) -> int:
        return int(self.max_group_mb * 1024 * 1024)


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """One gradient: its name, shape, dtype name and the index of its last producer."""

    name: str
    shape: tuple
    dtype: str
    producer: int = -1

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * ops.element_size(self.dtype)


@dataclasses.dataclass(frozen=True)
class Group:
    """Gradients reduced by one ``all_reduce``; ``offsets`` are element offsets in the fused buffer."""

    dtype: str
    slots: tuple
    fused_name: str = ""

    @property
    def offsets(self) -> tuple:
        out, acc = [], 0
        for s in self.slots:
            out.append(acc)
            acc += s.numel
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def insert_after(self) -> int:
        return max(s.producer for s in self.slots)


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """The groups of one rewritten program, in program order."""

    groups: tuple
    fused: bool
    nranks: int

    @property
    def num_allreduce(self) -> int:
        return len(self.groups)

    def describe(self) -> list:
        """Plain data, one item per group: ``[dtype, [(name, shape, dtype), ...]]``."""
        return [[g.dtype, [(s.name, tuple(s.shape), s.dtype) for s in g.slots]] for g in self.groups]

    def entries(self) -> list:
        """The layout as the flat list of hashable entries :mod:`paddle_hybrid.common.layout_check`
        compares across ranks: ``("fused", fused)`` first, then one
        ``(group index, name, shape, dtype)`` per gradient, so a moved group boundary differs too."""
        out: list = [("fused", self.fused)]
        for gi, g in enumerate(self.groups):
            out.extend((gi, s.name, tuple(s.shape), s.dtype) for s in g.slots)
        return out


def describe_entry(entry) -> str:
    """One entry of :meth:`FusedLayout.entries` for an error message."""
    if entry[0] == "fused":
        return "a fused layout" if entry[1] else "an unfused layout (one all_reduce per gradient)"
    gi, name, shape, dtype = entry
    return f"gradient {name!r} shape {list(shape)} {dtype} in group {gi}"


def layout_fingerprint(layout: FusedLayout) -> str:
    """SHA-256 of the layout's entries (names, shapes, dtypes, group boundaries)."""
    return hashlib.sha256(repr(layout.entries()).encode()).hexdigest()


def plan_groups(slots: Sequence[GradSlot], config: FuseAllreduceConfig) -> list:
    """Group ``slots`` (in the order backward finishes them) by dtype and limits.

    Slots are ordered by ``producer`` (ties keep the given order).  Each dtype has one open
    group; it is closed before adding a slot that would make it exceed
    ``config.max_group_count`` gradients or ``config.max_group_bytes`` bytes, whichever comes
    first.  A slot bigger than the byte limit gets a group of its own.  With ``config.fuse``
    False every slot is its own group.  Groups are returned ordered by the position of their
    all_reduce.
    """
    order = sorted(range(len(slots)), key=lambda i: (slots[i].producer, i))
    closed: list = []  # (creation index, [slots])
    open_by_dtype: dict = {}
    counter = 0
    for i in order:
        s = slots[i]
        if not config.fuse:
            closed.append((counter, [s]))
            counter += 1
            continue
        cur = open_by_dtype.get(s.dtype)
        if cur is not None:
            members = cur[1]
            too_many = len(members) + 1 > config.max_group_count
            too_big = sum(m.nbytes for m in members) + s.nbytes > config.max_group_bytes
            if too_many or too_big:
                closed.append(cur)
                cur = None
        if cur is None:
            cur = (counter, [])
            counter += 1
            open_by_dtype[s.dtype] = cur
        cur[1].append(s)
    closed.extend(open_by_dtype.values())
    groups = [Group(dtype=m[0].dtype, slots=tuple(m)) for _, m in sorted(closed, key=lambda c: c[0])]
    # position of each all_reduce: after the group's last producer; ties keep creation order
    return sorted(groups, key=lambda g: g.insert_after)
