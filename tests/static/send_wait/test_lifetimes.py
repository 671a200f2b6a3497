"""The send-lifetime checker on its own: stock section programs pass, broken ones fail, among
them a wrong rewrite that agrees with the pass's own idea of the matching recv (a keep-alive
after a recv from another peer).  send_v2/recv_v2 have no CPU kernels; nothing is executed."""
import paddle
import pytest

from paddle_hybrid import ops
from paddle_hybrid.static.send_wait import SendLifetimeError, apply_pipeline_send_wait, check_send_lifetimes, forward_sends, phase
from paddle_hybrid.testing.static_programs import build_pipeline_program

from foreign_recv import with_foreign_backward_recv


@pytest.fixture
def raw_1f1b_stage0():
    """Stage 0 of 3, 1F1B, upstream's send-sync optimization off (syncs present)."""
    with paddle.pir_utils.OldIrGuard():
        yield build_pipeline_program(0, stages=3, schedule="1F1B", branches=2, upstream_send_sync_opt=False)


def test_checker_flags_removed_sync(raw_1f1b_stage0):
    program = raw_1f1b_stage0
    block = program.global_block()
    victim = forward_sends(block)[1][2]
    idx = next(i for i, op in enumerate(block.ops)
               if op.type == "c_sync_comm_stream" and op.input("X") == [victim])
    block._remove_op(idx)
    with pytest.raises(SendLifetimeError, match=victim.replace(".", r"\.")) as info:
        check_send_lifetimes(program)
    assert info.value.var_name == victim


def test_checker_flags_missing_nop(raw_1f1b_stage0):
    program = raw_1f1b_stage0
    apply_pipeline_send_wait(program)
    block = program.global_block()
    check_send_lifetimes(program)
    victim = forward_sends(block)[0][2]
    idx = next(i for i, op in enumerate(block.ops) if op.type == ops.NOP_OP and op.input(ops.NOP_IN) == [victim])
    block._remove_op(idx)
    with pytest.raises(SendLifetimeError, match="freed before its send completes") as info:
        check_send_lifetimes(program)
    assert info.value.var_name == victim


def test_checker_flags_async_send_without_keepalive():
    with paddle.pir_utils.OldIrGuard():
        program = build_pipeline_program(0, stages=2, schedule="F-then-B")
        block = program.global_block()
        check_send_lifetimes(program)  # calc-stream send: fine
        _, send, name = forward_sends(block)[0]
        send._set_attr("use_calc_stream", False)
        with pytest.raises(SendLifetimeError) as info:
            check_send_lifetimes(program)
        assert info.value.var_name == name


def test_checker_flags_no_backward_recv():
    with paddle.pir_utils.OldIrGuard():
        program = build_pipeline_program(0, stages=2, schedule="1F1B", upstream_send_sync_opt=False)
        block = program.global_block()
        for i in range(len(block.ops) - 1, -1, -1):
            if block.ops[i].type in ("recv_v2", "c_sync_comm_stream") and phase(block.ops[i]) >= 1:
                block._remove_op(i)
        name = forward_sends(block)[0][2]
        with pytest.raises(SendLifetimeError, match="no backward recv"):
            check_send_lifetimes(program)
        result = apply_pipeline_send_wait(program)  # nothing to wait on: the pass leaves it alone
        assert result.kept == [name] and not result.changed


def test_checker_rejects_keepalive_after_a_recv_from_another_peer():
    """The deliberately wrong rewrite: syncs removed, every ``ph_nop`` right after the first
    backward recv, which here comes from the previous stage.  That recv completing says nothing
    about the sends to the next stage; the checker (its own ring pairing) must refuse it.  The old
    checker, which asked the pass for the matching recv, accepted it."""
    with paddle.pir_utils.OldIrGuard():
        program, foreign = with_foreign_backward_recv()
        block = program.global_block()
        sent = {name for _, _, name in forward_sends(block)}
        for i in range(len(block.ops) - 1, -1, -1):
            if block.ops[i].type == "c_sync_comm_stream" and set(block.ops[i].input_arg_names) <= sent:
                block._remove_op(i)
        for name in sorted(sent):
            block._insert_op(foreign + 1, type=ops.NOP_OP, inputs={ops.NOP_IN: [name]},
                             outputs={ops.NOP_OUT: [name]}, attrs={"op_role": 1})
        with pytest.raises(SendLifetimeError, match="from the send's peer") as info:
            check_send_lifetimes(program)
        assert info.value.var_name in sent


def test_checker_wants_the_sync_on_the_send_ring():
    """A ``c_sync_comm_stream`` in the forward phase right after the send waits for it (nothing
    else keeps the variable alive); one of another ring does not."""
    with paddle.pir_utils.OldIrGuard():
        program = build_pipeline_program(0, stages=2, schedule="1F1B", upstream_send_sync_opt=False)
        block = program.global_block()
        name = forward_sends(block)[0][2]
        sync = next(op for op in block.ops if op.type == "c_sync_comm_stream" and op.input("X") == [name])
        sync._set_attr("op_role", 0)  # forward phase: before the backward recv, so no keep-alive
        check_send_lifetimes(program)
        sync._set_attr("ring_id", sync.attr("ring_id") + 7)
        with pytest.raises(SendLifetimeError) as info:
            check_send_lifetimes(program)
        assert info.value.var_name == name


def test_rejects_non_program():
    with pytest.raises(TypeError, match="legacy paddle.static.Program"):
        check_send_lifetimes(object())
