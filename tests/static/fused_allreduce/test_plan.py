"""Grouping of gradients and the layout ranks compare (plain data, no programs)."""
import pytest

from paddle_hybrid.static.fused_allreduce import FuseAllreduceConfig, FusedLayout, GradSlot, Group, layout_fingerprint, plan_groups
from paddle_hybrid.static.fused_allreduce.plan import describe_entry
from paddle_hybrid.common.layout_check import first_difference

MB = 1024 * 1024


def slots(spec):
    """spec: list of (numel, dtype); producers in list order."""
    return [GradSlot(f"g{i}", (n,), dt, producer=i) for i, (n, dt) in enumerate(spec)]


def names(groups):
    return [[s.name for s in g.slots] for g in groups]


def test_groups_by_count():
    g = plan_groups(slots([(10, "float32")] * 7), FuseAllreduceConfig(nranks=2, max_group_count=3))
    assert names(g) == [["g0", "g1", "g2"], ["g3", "g4", "g5"], ["g6"]]


def test_groups_by_bytes():
    # 0.25 MiB float32 each = 65536 elements; 1 MiB limit -> 4 per group
    q = MB // 4 // 4
    g = plan_groups(slots([(q, "float32")] * 9), FuseAllreduceConfig(nranks=2, max_group_mb=1, max_group_count=100))
    assert names(g) == [["g0", "g1", "g2", "g3"], ["g4", "g5", "g6", "g7"], ["g8"]]
    assert all(grp.nbytes <= MB for grp in g)


def test_whichever_limit_is_reached_first_closes_the_group():
    q = MB // 4 // 4
    cfg = FuseAllreduceConfig(nranks=2, max_group_mb=1, max_group_count=2)  # count is stricter
    assert [len(x.slots) for x in plan_groups(slots([(q, "float32")] * 4), cfg)] == [2, 2]
    cfg = FuseAllreduceConfig(nranks=2, max_group_mb=0.5, max_group_count=8)  # bytes are stricter
    assert [len(x.slots) for x in plan_groups(slots([(q, "float32")] * 4), cfg)] == [2, 2]


def test_oversized_gradient_gets_its_own_group():
    big = 2 * MB // 4
    g = plan_groups(slots([(10, "float32"), (big, "float32"), (10, "float32")]),
                    FuseAllreduceConfig(nranks=2, max_group_mb=1, max_group_count=8))
    assert names(g) == [["g0"], ["g1"], ["g2"]]


def test_dtypes_never_mix_and_groups_follow_backward_order():
    spec = [(10, "float32"), (10, "float16"), (10, "float32"), (10, "float16"), (10, "float32")]
    g = plan_groups(slots(spec), FuseAllreduceConfig(nranks=2, max_group_count=2))
    assert all(len({s.dtype for s in grp.slots}) == 1 for grp in g)
    assert names(g) == [["g0", "g2"], ["g1", "g3"], ["g4"]]
    assert [grp.insert_after for grp in g] == [2, 3, 4]  # ordered by placement
    # a bf16/fp16 group is bounded by its own bytes: 2 bytes per element
    assert g[1].nbytes == 40 and g[0].nbytes == 80


def test_unfused_is_one_group_per_gradient():
    g = plan_groups(slots([(10, "float32")] * 3), FuseAllreduceConfig(nranks=2, fuse=False))
    assert names(g) == [["g0"], ["g1"], ["g2"]]


def test_offsets_are_packed():
    grp = Group("float32", tuple(slots([(3, "float32"), (5, "float32"), (2, "float32")])))
    assert grp.offsets == (0, 3, 8) and grp.numel == 10


@pytest.mark.parametrize("kw, word", [
    (dict(nranks=0), "nranks"),
    (dict(nranks=2, max_group_mb=0), "fuse_grad_size_in_MB"),
    (dict(nranks=2, max_group_count=0), "fuse_grad_size_in_num"),
])
def test_config_rejects_bad_values(kw, word):
    with pytest.raises(ValueError, match=word):
        FuseAllreduceConfig(**kw)


def test_fingerprint_and_entries_name_the_first_difference():
    a = FusedLayout((Group("float32", (GradSlot("w@GRAD", (4, 3), "float32"), GradSlot("b@GRAD", (3,), "float32"))),), True, 2)
    b = FusedLayout((Group("float32", (GradSlot("w@GRAD", (4, 3), "float32"), GradSlot("b@GRAD", (5,), "float32"))),), True, 2)
    c = FusedLayout((Group("float32", (GradSlot("w@GRAD", (4, 3), "float32"),)),
                     Group("float32", (GradSlot("b@GRAD", (3,), "float32"),))), True, 2)
    unfused = FusedLayout(c.groups, False, 2)
    assert layout_fingerprint(a) == layout_fingerprint(FusedLayout(a.groups, True, 2))
    assert len({layout_fingerprint(x) for x in (a, b, c, unfused)}) == 4
    k, x, y = first_difference(a.entries(), b.entries())
    assert describe_entry(x) == "gradient 'b@GRAD' shape [3] float32 in group 0"
    assert describe_entry(y) == "gradient 'b@GRAD' shape [5] float32 in group 0"
    _, x, y = first_difference(a.entries(), c.entries())  # a moved group boundary
    assert (describe_entry(x), describe_entry(y)) == ("gradient 'b@GRAD' shape [3] float32 in group 0",
                                                      "gradient 'b@GRAD' shape [3] float32 in group 1")
    _, x, y = first_difference(c.entries(), unfused.entries())
    assert "unfused" in describe_entry(y)
