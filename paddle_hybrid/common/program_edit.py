"""Editing legacy static programs without a ``_sync_with_cpp`` per edit.

``Block._insert_op``, ``_remove_op(sync=True)``, ``_remove_var(sync=True)``
and ``_rename_var`` each call ``Block._sync_with_cpp()``, which walks every var
and op of the block (~10 ms on a 2000-op block).  A pass inserting K ops pays
K walks.  Inside :func:`deferred_sync` those calls only mark the block as
touched; on exit every touched block is synced exactly once, also when the
body raises (Paddle PR 60022's idea, applied to every rewrite).

Every rewrite of this package edits programs only inside ``deferred_sync``, and reads op roles
through :func:`op_role` (the one helper for the ``op_role`` attribute).

Precondition: the Python side of a block matches its C++ desc on entry (true
unless something edited the desc directly).  If the op counts differ on entry
the block is synced once first, so edits by index stay correct.

Counting the syncs (for tests and benchmarks) is :mod:`paddle_hybrid.testing.sync_count`'s
``count_syncs``; the old name ``program_edit.count_syncs`` (and ``SyncCount``) still resolves
to it, with a ``DeprecationWarning``.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from paddle.base import core, framework

__all__ = ["deferred_sync", "op_role", "OpRole", "OP_ROLE_KEY", "OP_DEVICE_KEY"]

OpRole = core.op_proto_and_checker_maker.OpRole
"""Paddle's op roles (``Forward`` 0, ``Backward`` 1, ``Optimize`` 2, ``LRSched`` 16, ``Loss`` 256 ...);
a role is a bit set: the loss gradient op is ``Backward | Loss``."""

OP_ROLE_KEY = core.op_proto_and_checker_maker.kOpRoleAttrName()
OP_DEVICE_KEY = core.op_proto_and_checker_maker.kOpDeviceAttrName()


def op_role(op) -> int:
    """The ``op_role`` of a legacy op as an int; an op without the attribute counts as
    ``Forward`` (0), as Paddle's executors treat it."""
    return int(op.attr(OP_ROLE_KEY)) if op.has_attr(OP_ROLE_KEY) else 0

_state = threading.local()


def _blocks_of(target) -> list:
    if isinstance(target, framework.Program):
        return list(target.blocks)
    if isinstance(target, framework.Block):
        return [target]
    if isinstance(target, (list, tuple)):
        out = []
        for t in target:
            out.extend(_blocks_of(t))
        return out
    raise TypeError(
        f"deferred_sync: expected a legacy Program or Block (or a list of them), got "
        f"{type(target).__name__}. PIR programs need no sync; build legacy programs under "
        "paddle.pir_utils.OldIrGuard()."
    )


def _depths() -> dict:
    if not hasattr(_state, "depth"):
        _state.depth = {}
    return _state.depth


@contextlib.contextmanager
def deferred_sync(target) -> Iterator[list]:
    """Defer ``_sync_with_cpp`` of ``target`` (a Program: all its blocks, or a
    Block) until exit; then sync each block that asked for a sync, once.

    Yields the list of blocks covered.  Nested use on the same block is
    allowed: only the outermost exit syncs.
    """
    blocks = _blocks_of(target)
    depths = _depths()
    touched: dict[int, framework.Block] = {}
    entered = []
    try:
        for block in blocks:
            key = id(block)
            if depths.get(key, 0) == 0:
                if len(block.ops) != block.desc.op_size():
                    block._sync_with_cpp()  # bring Python up to the desc before index edits

                def _mark(block=block):
                    touched[id(block)] = block

                block._sync_with_cpp = _mark  # instance attribute shadows the method
            depths[key] = depths.get(key, 0) + 1
            entered.append(block)
        yield blocks
    finally:
        errors = []
        for block in reversed(entered):
            key = id(block)
            depths[key] -= 1
            if depths[key] == 0:
                del depths[key]
                try:
                    del block._sync_with_cpp  # back to Block._sync_with_cpp
                except AttributeError:
                    pass
                if key in touched:
                    try:
                        block._sync_with_cpp()
                    except Exception as exc:  # sync every block before re-raising
                        errors.append(exc)
        if errors:
            raise errors[0]


_MOVED_TO_TESTING = ("count_syncs", "SyncCount")


def __getattr__(name):
    """``count_syncs`` and ``SyncCount`` moved to :mod:`paddle_hybrid.testing.sync_count`: the old
    names still resolve to the same objects, with a ``DeprecationWarning``."""
    if name in _MOVED_TO_TESTING:  # through the package's table of moved names: no import upward from here
        from .. import _moved

        return _moved.moved_attribute(__name__, name, "paddle_hybrid.testing.sync_count")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
