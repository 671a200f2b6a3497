"""Legacy auto-parallel reshard without a ``_sync_with_cpp`` per inserted op.

Paddle's ``Resharder`` (``paddle.distributed.auto_parallel.static.reshard``)
has ``sync=`` switches on its inserters, but ``Resharder._reshard_input`` calls
``parse_op_desc`` without one, so every op reshard inserts walks the whole
block (``Block._insert_op`` = sync + insert): O(inserts x block size).

This component wraps ``Resharder.reshard`` (the one patched function) so that
the whole call runs inside :func:`paddle_hybrid.common.program_edit.deferred_sync` on
the main and startup programs: inserts and removals stay, syncs become one per
touched block at the end.  While it runs, the reshard module's
``new_process_group`` (called for every op of every rank in ``parse_op_desc``,
each call a linear scan of all groups) answers repeated lookups from an index;
groups are still created by Paddle's function, in the same order with the same
ids.  The resulting programs and process groups are identical to stock
(``tests/reshard/test_reshard.py``).

The wrapper is installed by ``import paddle_hybrid`` (component
``paddle_hybrid.static.reshard`` of :mod:`paddle_hybrid.catalog.install`) when ``PluginConfig.reshard`` is
True, and removed by :func:`uninstall`.  It is only installed on the Paddle
source it was checked against: if ``reshard.py`` or ``new_process_group``
differ from Paddle 3.3.1's, a :class:`ReshardPatchWarning` says so and stock
reshard is left alone.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect

from ...common.program_edit import deferred_sync

__all__ = ["apply", "is_installed", "ReshardPatchWarning", "EXPECTED_SOURCES",
           "source_mismatches"]

# sha256 of the sources the patch was written and tested against (Paddle 3.3.1; 3.2.2 hashes the same):
# the whole reshard module (every insert/remove path runs under the deferral)
# and process_group.new_process_group (whose lookups are indexed).
EXPECTED_SOURCES = {
    "paddle.distributed.auto_parallel.static.reshard":
        "b0b722b0617cb3bd98710ce2ec88c56f08fe81d2d476ff80e25bb0d0dfb2ba35",
    "paddle.distributed.auto_parallel.static.process_group.new_process_group":
        "486a4c01f4bf900d9ebdb1e3f9067af7b8c7039346a08a67e3bc4518001c4c20",
}


class ReshardPatchWarning(RuntimeWarning):
    """The reshard patch was not installed because Paddle's source differs."""


def _modules():
    from paddle.distributed.auto_parallel.static import process_group, reshard

    return reshard, process_group


def source_mismatches() -> list[str]:
    """Names in :data:`EXPECTED_SOURCES` whose installed source differs."""
    reshard, process_group = _modules()
    objects = {
        "paddle.distributed.auto_parallel.static.reshard": reshard,
        "paddle.distributed.auto_parallel.static.process_group.new_process_group":
            process_group.new_process_group,
    }
    bad = []
    for name, expected in EXPECTED_SOURCES.items():
        try:
            digest = hashlib.sha256(inspect.getsource(objects[name]).encode()).hexdigest()
        except (OSError, TypeError):
            digest = None
        if digest != expected:
            bad.append(name)
    return bad


class _GroupIndex:
    """``new_process_group`` with an index over existing groups.

    Paddle's function returns the first group (other than group 0, in creation
    order) whose ``'_'.join(ranks)`` equals the requested one, else creates one.
    Hits are answered from the index (checked: still registered under its id,
    same ranks); misses, explicit ``group_id`` and ``force_new_group`` go to
    Paddle's function, so creation, ids and order are Paddle's.
    """

    def __init__(self, process_group, original):
        self._pg = process_group
        self._original = original
        self._map = None
        self._size = -1
        self._index: dict[str, object] = {}

    def _rebuild(self, groups):
        self._index = {}
        for gid, group in groups.items():
            if gid != 0:
                self._index.setdefault("_".join(map(str, group.ranks)), group)
        self._map, self._size = groups, len(groups)

    def __call__(self, ranks, group_id=None, force_new_group=False, group_type=None):
        if group_id is not None or force_new_group:
            self._map = None
            return self._original(ranks, group_id=group_id, force_new_group=force_new_group,
                                  group_type=group_type)
        groups = self._pg._g_process_group_map
        if groups is not self._map or len(groups) != self._size:
            self._rebuild(groups)
        key = "_".join(map(str, ranks))
        group = self._index.get(key)
        if group is not None and groups.get(group.id) is group and "_".join(map(str, group.ranks)) == key:
            return group
        group = self._original(ranks, group_type=group_type)
        self._rebuild(self._pg._g_process_group_map)
        return group


@contextlib.contextmanager
def _indexed_process_groups():
    reshard, process_group = _modules()
    original = reshard.new_process_group
    reshard.new_process_group = _GroupIndex(process_group, original)
    try:
        yield
    finally:
        reshard.new_process_group = original


def _make_wrapper(original):
    @functools.wraps(original)
    def reshard(self):
        programs = [p for p in (self.auto_parallel_main_prog, self.auto_parallel_startup_prog) if p is not None]
        with deferred_sync(programs), _indexed_process_groups():
            return original(self)

    reshard.__paddle_hybrid_original__ = original
    return reshard




def apply(config, patcher) -> None:
    """Wrap ``Resharder.reshard`` if the installed Paddle's source is the checked one; skip
    (the registry warns, stock reshard stays) otherwise."""
    from ...registry.component import ComponentSkipped

    reshard, _ = _modules()
    bad = source_mismatches()
    if bad:
        import paddle

        skipped = ComponentSkipped(
            f"reshard without per-insert sync NOT installed: the source of {', '.join(bad)} in Paddle "
            f"{paddle.__version__} differs from the source the patch was checked against, so stock (slower) "
            "reshard is used. Check the patch against this Paddle and update "
            "paddle_hybrid.static.reshard.deferred.EXPECTED_SOURCES")
        skipped.category = ReshardPatchWarning
        raise skipped
    patcher.set(reshard.Resharder, "reshard", _make_wrapper(reshard.Resharder.reshard))


def is_installed() -> bool:
    from . import COMPONENT

    return COMPONENT.is_active()
