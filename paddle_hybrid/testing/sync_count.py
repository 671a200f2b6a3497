"""Counting ``Block._sync_with_cpp`` calls: how tests and benchmarks measure what
:func:`paddle_hybrid.common.program_edit.deferred_sync` saves.

:func:`count_syncs` wraps ``Block._sync_with_cpp`` through a
:class:`~paddle_hybrid.registry.patching.Patcher` of its own, so the wrapper is undone like every
other change of Paddle: it wraps whatever it finds (another component's wrapper, or an enclosing
``count_syncs``), and may be undone before or after a wrapper installed over it without throwing
that one away.  A block inside ``deferred_sync`` shadows the method by an instance attribute, so
its deferred requests are not counted: only real syncs are.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

from paddle.base import framework

from ..registry.patching import Patcher

__all__ = ["count_syncs", "SyncCount"]


class SyncCount(Counter):
    """Calls of ``Block._sync_with_cpp`` per block idx, and ``total``."""

    @property
    def total(self) -> int:
        return sum(self.values())


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCount]:
    """Count real ``Block._sync_with_cpp`` calls (per block idx) while inside."""
    counts = SyncCount()
    original = framework.Block._sync_with_cpp

    def _sync_with_cpp(self):
        counts[self.idx] += 1
        return original(self)

    patcher = Patcher("paddle_hybrid.testing.count_syncs", "nothing (a measuring instrument: leave the with block)")
    patcher.set(framework.Block, "_sync_with_cpp", _sync_with_cpp)
    try:
        yield counts
    finally:
        patcher.revert()
