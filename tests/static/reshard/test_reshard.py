"""Legacy auto-parallel reshard with the plugin gives the same programs (ops,
vars, attrs, dist attrs, process groups) as stock Paddle, with one sync per
touched block instead of one per insert."""
import dataclasses
import re

import paddle
import pytest

import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.static.reshard import deferred as reshard_patch
from paddle_hybrid.testing.sync_count import count_syncs

from paddle_hybrid.testing.static_programs import (
    build_auto_parallel_program,
    dist_signature,
    process_groups,
    program_signature,
    run_reshard,
)

# (dp, mp, pp, layers, rank, stress): dp x pp, mp x pp and dp x mp x pp meshes,
# ranks on first, middle and last stages; stress: the benchmark's layout, small.
CASES = [
    (2, 1, 2, 2, 0, False),
    (2, 1, 2, 2, 3, False),
    (1, 2, 2, 2, 0, False),
    (1, 2, 2, 4, 3, False),
    (1, 2, 3, 3, 2, False),
    (2, 2, 2, 2, 1, False),
    (2, 2, 2, 4, 6, False),
    (1, 4, 2, 4, 4, True),
]


@pytest.fixture
def plugin_reshard():
    """The reshard component as ``import paddle_hybrid`` leaves it, restored after."""
    was = reshard_patch.is_installed()
    yield
    if reshard_patch.is_installed() and not was:
        paddle_hybrid.uninstall_component("reshard")
    elif was and not reshard_patch.is_installed():
        paddle_hybrid.install_component("reshard", PluginConfig())


def _resharded(rank, installed, **kw):
    if installed:
        paddle_hybrid.install_component("reshard", PluginConfig())
        assert reshard_patch.is_installed()
    else:
        paddle_hybrid.uninstall_component("reshard")
        assert not reshard_patch.is_installed()
    with paddle.pir_utils.OldIrGuard():
        main, startup, ctx, pg = build_auto_parallel_program(rank, **kw)
        before = len(main.global_block().ops)
        with count_syncs() as syncs:
            run_reshard(rank, main, startup, ctx, pg)
        return {
            "main": program_signature(main),
            "startup": program_signature(startup),
            "dist": dist_signature(main, ctx),
            "groups": process_groups(),
            "syncs": syncs.total,
            "blocks": main.num_blocks + startup.num_blocks,
            "changed": [op.type for op in main.global_block().ops].count("send_v2")
            + [op.type for op in main.global_block().ops].count("recv_v2")
            + [op.type for op in main.global_block().ops].count("all_gather")
            + int(len(main.global_block().ops) != before),
        }


def test_installed_by_import():
    assert "reshard" in paddle_hybrid.installed_components()
    assert reshard_patch.is_installed()
    from paddle.distributed.auto_parallel.static.reshard import Resharder

    assert Resharder.reshard.__paddle_hybrid_original__ is not None


@pytest.mark.parametrize("dp,mp,pp,layers,rank,stress", CASES)
def test_identical_program_and_fewer_syncs(plugin_reshard, dp, mp, pp, layers, rank, stress):
    kw = dict(dp=dp, mp=mp, pp=pp, layers=layers, layer_norm=(layers > 2), stress=stress, batch=max(4, mp))
    stock = _resharded(rank, installed=False, **kw)
    plugin = _resharded(rank, installed=True, **kw)
    assert stock["changed"] > 0, "the case must make reshard insert ops"
    for key in ("main", "startup", "dist", "groups"):
        assert plugin[key] == stock[key], key
    assert plugin["syncs"] <= plugin["blocks"]
    assert stock["syncs"] > plugin["syncs"]


def test_uninstall_restores_stock(plugin_reshard):
    from paddle.distributed.auto_parallel.static.reshard import Resharder

    paddle_hybrid.uninstall_component("reshard")
    assert not hasattr(Resharder.reshard, "__paddle_hybrid_original__")
    with paddle.pir_utils.OldIrGuard():
        main, startup, ctx, pg = build_auto_parallel_program(0, mp=2, pp=2, layers=2)
        with count_syncs() as syncs:
            run_reshard(0, main, startup, ctx, pg)
    inserted = sum(op.type in ("send_v2", "recv_v2") for op in main.global_block().ops)
    assert inserted > 0 and syncs.total > inserted  # stock: a sync per insert
    paddle_hybrid.install_component("reshard", PluginConfig())
    assert Resharder.reshard.__paddle_hybrid_original__ is not None


def test_config_switch_off(plugin_reshard):
    paddle_hybrid.uninstall_component("reshard")
    paddle_hybrid.install_component("reshard", dataclasses.replace(PluginConfig(), reshard=False))
    assert not reshard_patch.is_installed()


def test_env_switch(monkeypatch):
    monkeypatch.setenv("PADDLE_HYBRID_RESHARD", "0")
    assert PluginConfig.from_env().reshard is False
    monkeypatch.setenv("PADDLE_HYBRID_RESHARD", "maybe")
    with pytest.raises(ValueError, match="PADDLE_HYBRID_RESHARD"):
        PluginConfig.from_env()


def test_refuses_other_paddle_source(plugin_reshard, monkeypatch):
    paddle_hybrid.uninstall_component("reshard")
    key = "paddle.distributed.auto_parallel.static.reshard"
    monkeypatch.setitem(reshard_patch.EXPECTED_SOURCES, key, "0" * 64)
    with pytest.warns(reshard_patch.ReshardPatchWarning, match=rf"NOT installed.*reshard.*Paddle {re.escape(paddle.__version__)} differs"):
        paddle_hybrid.install_component("reshard", PluginConfig())
    assert not reshard_patch.is_installed()
    assert reshard_patch.source_mismatches() == [key]


def test_group_index_matches_paddle():
    """The indexed new_process_group returns Paddle's group for every lookup
    and creates new ones through Paddle (same ids, same order)."""
    from paddle.distributed.auto_parallel.static import process_group as pgm

    def shape(groups):  # ring ids also count collective's global rings: compare the pattern
        first = {}
        return [first.setdefault(g.id, len(first)) for g in groups], [tuple(g.ranks) for g in groups]

    requests = [[0, 1], [2, 3], [0, 1], [1, 0], [0, 1, 2, 3], [2, 3], [1, 0]]
    pgm.clear_all_process_groups()
    stock = shape([pgm.new_process_group(r) for r in requests])
    stock_groups = shape(pgm.get_all_process_groups())
    pgm.clear_all_process_groups()
    index = reshard_patch._GroupIndex(pgm, pgm.new_process_group)
    assert shape([index(r) for r in requests]) == stock
    assert stock[0] == [0, 1, 0, 2, 3, 1, 2]
    assert shape(pgm.get_all_process_groups()) == stock_groups
    # a group created behind the index's back is found, not duplicated
    extra = pgm.new_process_group([5, 6])
    assert index([5, 6]) is extra
    pgm.clear_all_process_groups()
