"""The fused all-reduce rewrite of legacy programs, the startup broadcast and the Paddle pass
``ph_fuse_allreduce``: program structure in one process (no collective runs)."""
import paddle
import pytest
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

import models
import paddle_hybrid
from paddle_hybrid import ops
from paddle_hybrid.static.fused_allreduce import FuseAllreduceConfig, apply_fuse_allreduce, broadcast_parameters
from paddle_hybrid.testing.sync_count import count_syncs
from paddle_hybrid.testing.static_programs import program_signature


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


def test_rewrite_rejects_pir_program():
    with pytest.raises(TypeError, match="OldIrGuard"):
        apply_fuse_allreduce(paddle.static.Program(), [], FuseAllreduceConfig(nranks=2))


def test_registered_with_fleet_and_uninstall_removes_it():
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    assert "FusedAllreduceOptimizer" in factory.meta_optimizer_names
    assert factory.FusedAllreduceOptimizer.__module__ == "paddle_hybrid.static.fused_allreduce.meta_optimizer"
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    try:
        assert "FusedAllreduceOptimizer" not in factory.meta_optimizer_names
        assert not hasattr(factory, "FusedAllreduceOptimizer")
    finally:
        paddle_hybrid.install(config)
    assert "FusedAllreduceOptimizer" in factory.meta_optimizer_names


# --------------------------------------------------------------------------- startup broadcast
def _broadcast_names(startup):
    return [op.input("x")[0] for op in startup.global_block().ops if op.type == "broadcast"]


def test_broadcast_covers_every_parameter_no_broadcast_covers_yet():
    """A startup program that already broadcasts one parameter still gets a broadcast for every
    other one (the old meta optimizer skipped them all as soon as it saw any broadcast), and a
    second call adds nothing."""
    _, startup, _ = build("mlp")
    block = startup.global_block()
    params = sorted(p.name for p in block.iter_parameters())
    with OldIrGuard():
        block.append_op(type="broadcast", inputs={"x": [params[0]]}, outputs={"out": [params[0]]},
                        attrs={"ring_id": 0, "root": 0})
        block.append_op(type="broadcast", inputs={"x": [params[1]]}, outputs={"out": [params[1]]},
                        attrs={"ring_id": 5, "root": 0})  # another ring: does not cover the DP ring
        added = broadcast_parameters(startup)
        assert sorted(added) == params[1:]
        assert sorted(_broadcast_names(startup)) == sorted(params + [params[1]])
        assert broadcast_parameters(startup) == []
    dp_ring = [op for op in block.ops if op.type == "broadcast" and op.attr("ring_id") == 0]
    assert sorted(op.input("x")[0] for op in dp_ring) == params and all(op.attr("root") == 0 for op in dp_ring)


# --------------------------------------------------------------------------- the Paddle pass
def _pass_attrs(params_grads, **kw):
    return {"params_grads": params_grads, "nranks": 2, "max_group_count": 3, **kw}


def test_paddle_pass_equals_the_functions():
    """``new_pass("ph_fuse_allreduce", attrs).apply`` gives the main and startup programs that
    ``apply_fuse_allreduce`` + ``broadcast_parameters`` give (structure compared op for op)."""
    from paddle.distributed.passes import PassManager, new_pass

    expected_main, expected_startup, pg = build("tfm")
    with OldIrGuard(), unique_name.guard():
        layout = apply_fuse_allreduce(expected_main, pg, FuseAllreduceConfig(nranks=2, max_group_count=3))
        broadcast_parameters(expected_startup)
    main, startup, pg = build("tfm")
    with OldIrGuard(), unique_name.guard():
        manager = PassManager([new_pass("ph_fuse_allreduce", _pass_attrs(pg))])
        context = manager.apply([main], [startup])
    assert manager.names == ["ph_fuse_allreduce"]
    assert context.get_attr("ph_fuse_allreduce").describe() == layout.describe()
    assert program_signature(main) == program_signature(expected_main)
    assert program_signature(startup) == program_signature(expected_startup)
    assert [op.type for op in main.global_block().ops].count(ops.COALESCE_OP) == 4


def test_paddle_pass_refuses_bad_attributes_and_paddles_fuse_all_reduce():
    from paddle.distributed.passes import PassContext, new_pass

    main, startup, pg = build("mlp")
    with pytest.raises(ValueError, match=r"\['nranks'\] are required"):
        new_pass("ph_fuse_allreduce", {"params_grads": pg}).apply([main], [startup])
    with pytest.raises(ValueError, match=r"\['max_group_num'\] are unknown"):
        new_pass("ph_fuse_allreduce", _pass_attrs(pg, max_group_num=2)).apply([main], [startup])
    with pytest.raises(ValueError, match="fuse_grad_size_in_num"):
        new_pass("ph_fuse_allreduce", _pass_attrs(pg, max_group_count=0)).apply([main], [startup])
    # after Paddle's own fuse_all_reduce in the same context the pass does not apply (Paddle's rule)
    context = PassContext()
    context._add_pass(new_pass("fuse_all_reduce"))
    with OldIrGuard():
        new_pass("ph_fuse_allreduce", _pass_attrs(pg)).apply([main], [startup], context)
    assert ops.COALESCE_OP not in [op.type for op in main.global_block().ops]


def test_paddle_pass_goes_with_uninstall():
    from paddle.distributed.passes import new_pass

    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component("fused_allreduce")
    try:
        with pytest.raises(AssertionError, match="ph_fuse_allreduce is not registered"):
            new_pass("ph_fuse_allreduce", {})
    finally:
        paddle_hybrid.install_component("fused_allreduce", config)
    assert new_pass("ph_fuse_allreduce", {}).name == "ph_fuse_allreduce"
