"""Structure of the fused all-reduce rewrite, in one process (no execution of collectives)."""
import os
import sys

import numpy as np
import paddle
import pytest
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

import paddle_hybrid
from paddle_hybrid import ops
from paddle_hybrid.passes.fuse_allreduce import (
    FuseAllreduceConfig,
    FusedLayout,
    GradSlot,
    Group,
    apply_fuse_allreduce,
    first_difference,
    layout_fingerprint,
    plan_groups,
)
from paddle_hybrid.pir_compat import repair_custom_vector_ops, translate_with_repair
from paddle_hybrid.program_edit import count_syncs
from paddle_hybrid.static_runtime import StaticRunner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

MB = 1024 * 1024


def slots(spec):
    """spec: list of (numel, dtype); producers in list order."""
    return [GradSlot(f"g{i}", (n,), dt, producer=i) for i, (n, dt) in enumerate(spec)]


def names(groups):
    return [[s.name for s in g.slots] for g in groups]


# --------------------------------------------------------------------------- plan_groups
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


# --------------------------------------------------------------------------- program rewrite
def build(kind="mlp", optimizer=None):
    paddle.enable_static()
    with OldIrGuard(), unique_name.guard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            _, _, loss = models.build(kind, 4)
            opt = optimizer or paddle.optimizer.Adam(0.01, grad_clip=paddle.nn.ClipGradByNorm(1.0))
            _, params_grads = opt.minimize(loss)
    return main, startup, params_grads


def test_allreduce_placed_right_after_last_producer_and_before_readers():
    main, _, pg = build("tfm")
    with OldIrGuard():
        before = [op for op in main.global_block().ops]
        layout = apply_fuse_allreduce(main, pg, FuseAllreduceConfig(nranks=2, max_group_count=3))
        block = main.global_block()
        ops_ = block.ops
        assert len(ops_) > len(before)
        bwd_end = max(i for i, op in enumerate(ops_) if op.type.endswith("_grad"))
        coalesce_idx = [i for i, op in enumerate(ops_) if op.type == ops.COALESCE_OP]
        assert len(coalesce_idx) == layout.num_allreduce == 4
        assert coalesce_idx[0] < bwd_end, "the first group must be reduced while backward still runs"
        for gi, ci in enumerate(coalesce_idx):
            group = set(ops_[ci].input(ops.COALESCE_IN))
            assert group == {s.name for s in layout.groups[gi].slots}
            # the op right before is a producer of one of the group's grads ...
            assert group & set(ops_[ci - 1].output_arg_names), ops_[ci - 1].type
            # ... then all_reduce of the fused buffer and one ph_uncoalesce_tensor writing every grad back
            assert ops_[ci + 1].type == "all_reduce" and ops_[ci + 1].input("x") == ops_[ci].output(ops.COALESCE_FUSED)
            back = ops_[ci + 2]
            assert back.type == ops.UNCOALESCE_OP
            assert back.input(ops.UNCOALESCE_FUSED) == ops_[ci].output(ops.COALESCE_FUSED)
            assert back.input(ops.UNCOALESCE_IN) == ops_[ci].input(ops.COALESCE_IN) == back.output(ops.UNCOALESCE_OUT)
            last_copy = ci + 2
            for j, op in enumerate(ops_):
                touched = group & set(op.output_arg_names)
                if touched and j > last_copy:
                    pytest.fail(f"{op.type} at {j} writes {touched} after the group's all_reduce")
                if group & set(op.input_arg_names) and ci < j and op.type != "all_reduce":
                    assert j >= last_copy, (op.type, j)
        # every optimizer/clip reader of a gradient comes after its group's copy back
        readers = [i for i, op in enumerate(ops_) if op.type in ("clip_by_norm", "adam")]
        assert readers and min(readers) > max(coalesce_idx)


def test_loss_grad_scaled_by_one_over_nranks():
    main, _, pg = build("mlp")
    with OldIrGuard():
        apply_fuse_allreduce(main, pg, FuseAllreduceConfig(nranks=4))
        ops_ = main.global_block().ops
        i = next(i for i, op in enumerate(ops_) if op.type == "fill_constant" and op.output_arg_names[0].endswith("@GRAD"))
        assert ops_[i + 1].type == "scale" and ops_[i + 1].attr("scale") == pytest.approx(0.25)
        assert ops_[i + 1].input("X") == ops_[i].output("Out")


def test_rewrite_is_idempotent_and_syncs_once():
    main, _, pg = build("mlp")
    cfg = FuseAllreduceConfig(nranks=2, max_group_count=2)
    with OldIrGuard():
        with count_syncs() as n:
            first = apply_fuse_allreduce(main, pg, cfg)
        assert n.total <= 1  # never one sync per inserted op
        snapshot = [(op.type, op.input_arg_names, op.output_arg_names) for op in main.global_block().ops]
        second = apply_fuse_allreduce(main, pg, cfg)
        assert [(op.type, op.input_arg_names, op.output_arg_names) for op in main.global_block().ops] == snapshot
        assert second.describe() == first.describe()


def test_fingerprint_and_first_difference():
    a = FusedLayout((Group("float32", (GradSlot("w@GRAD", (4, 3), "float32"), GradSlot("b@GRAD", (3,), "float32"))),), True, 2)
    b = FusedLayout((Group("float32", (GradSlot("w@GRAD", (4, 3), "float32"), GradSlot("b@GRAD", (5,), "float32"))),), True, 2)
    c = FusedLayout((Group("float32", (GradSlot("w@GRAD", (4, 3), "float32"),)),
                     Group("float32", (GradSlot("b@GRAD", (3,), "float32"),))), True, 2)
    assert layout_fingerprint(a) == layout_fingerprint(FusedLayout(a.groups, True, 2))
    assert len({layout_fingerprint(x) for x in (a, b, c)}) == 3
    assert "'b@GRAD' shape [3]" in first_difference(a.describe(), b.describe())
    assert "group 0 vs 'b@GRAD' shape [3] float32 in group 1" in first_difference(a.describe(), c.describe())


def test_runner_rejects_program_without_rewrite():
    main, startup, _ = build("mlp")
    with pytest.raises(ValueError, match="not rewritten"):
        StaticRunner(main, startup)


def test_rewrite_rejects_pir_program():
    with pytest.raises(TypeError, match="OldIrGuard"):
        apply_fuse_allreduce(paddle.static.Program(), [], FuseAllreduceConfig(nranks=2))


# --------------------------------------------------------------------------- PIR repair
def test_translated_coalesce_is_repaired_and_runs():
    paddle.enable_static()
    with OldIrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [2, 3], "float32")
            y = paddle.static.data("y", [4], "float32")
            a, b = paddle.scale(x, 2.0), paddle.scale(y, 3.0)
            _, fused = ops.coalesce_tensor([a, b], copy_data=True, use_align=False)
            out = paddle.scale(fused, 1.0)
        raw = paddle.pir.translate_to_pir(main.desc)
    broken = [op for op in raw.global_block().ops if op.name() == "custom_op.ph_coalesce_tensor_"]
    assert len(broken) == 1 and not broken[0].result(0).is_combine()  # Paddle's translation bug
    assert repair_custom_vector_ops(raw) == 1
    assert repair_custom_vector_ops(raw) == 0  # nothing left to repair
    prog, mapping = translate_with_repair(main)
    xv, yv = np.arange(6, dtype="float32").reshape(2, 3), np.arange(4, dtype="float32")
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.pir_utils.IrGuard():
        (got,) = exe.run(prog, feed={"x": xv, "y": yv}, fetch_list=[mapping[out.name][-1]])
    np.testing.assert_array_equal(got, np.concatenate([2 * xv.ravel(), 3 * yv]))


# --------------------------------------------------------------------------- registration
def test_registered_with_fleet_and_uninstall_removes_it():
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    assert "FusedAllreduceOptimizer" in factory.meta_optimizer_names
    assert factory.FusedAllreduceOptimizer.__module__ == "paddle_hybrid.meta_optimizers.fuse_allreduce"
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    try:
        assert "FusedAllreduceOptimizer" not in factory.meta_optimizer_names
        assert not hasattr(factory, "FusedAllreduceOptimizer")
    finally:
        paddle_hybrid.install(config)
    assert "FusedAllreduceOptimizer" in factory.meta_optimizer_names
