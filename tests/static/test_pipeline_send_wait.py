"""Pipeline send-wait rewrite on section programs built by Paddle's
PipelineOptimizer (1F1B and F-then-B, with and without recompute, 2-4 stages)
and through fleet; the lifetime checker on good and broken programs.

send_v2/recv_v2 have no CPU kernels, so these tests check program structure;
nothing is executed."""
import json
import os
import subprocess
import sys

import paddle
import pytest

import paddle_hybrid
from paddle_hybrid import ops
from paddle_hybrid.analysis import SendLifetimeError, check_send_lifetimes
from paddle_hybrid.passes.pipeline_send_wait import apply_pipeline_send_wait, forward_sends, phase
from paddle_hybrid.program_edit import count_syncs

from static_programs import build_pipeline_program, program_signature

HERE = os.path.dirname(os.path.abspath(__file__))
REWRITE_TYPES = {"c_sync_comm_stream", "c_sync_calc_stream", "nop", ops.NOP_OP}


def _sent(block):
    return {name for _, _, name in forward_sends(block)}


def _waits(block):
    """Forward-send waits: syncs reading only forward-sent vars, calc-stream forward sends."""
    sent = _sent(block)
    syncs = [op for op in block.ops if op.type == "c_sync_comm_stream" and set(op.input_arg_names) <= sent]
    calc = [op for _, op, _ in forward_sends(block) if op.attr("use_calc_stream")]
    return len(syncs), len(calc)


def _core_ops(program):
    """Every op the rewrite must not touch, with forward sends' stream attr dropped."""
    out = []
    for op_sig in program_signature(program)[0][2]:
        if op_sig[0] in REWRITE_TYPES:
            continue
        if op_sig[0] == "send_v2":
            op_sig = op_sig[:3] + (tuple(a for a in op_sig[3] if a[0] != "use_calc_stream"),)
        out.append(op_sig)
    return out


def _check_rewritten(program):
    block = program.global_block()
    for send_idx, send, name in forward_sends(block):
        assert send.attr("use_calc_stream") is False
        prev = block.ops[send_idx - 1]
        assert prev.type == "c_sync_calc_stream" and prev.input("X") == [name]
        nops = [i for i, op in enumerate(block.ops) if op.type == ops.NOP_OP and op.input(ops.NOP_IN) == [name]]
        assert len(nops) == 1, name
        assert block.ops[nops[0]].output(ops.NOP_OUT) == [name]
        recv_idx = nops[0] - 1
        while block.ops[recv_idx].type == ops.NOP_OP:
            recv_idx -= 1
        recv = block.ops[recv_idx]
        assert recv.type == "recv_v2" and phase(recv) == 1 and phase(block.ops[nops[0]]) == 1
        first_backward_recv = next(i for i, op in enumerate(block.ops) if op.type == "recv_v2" and phase(op) == 1)
        assert recv_idx == first_backward_recv  # the earliest recv that implies every forward send completed
        assert not any(op.type == "c_sync_comm_stream" and name in op.input_arg_names for op in block.ops)
        assert not any(op.type == "nop" and name in op.input_arg_names for op in block.ops)


CASES = [(schedule, recompute, stages, upstream)
         for schedule in ("1F1B", "F-then-B") for recompute in (False, True) for stages in (2, 3, 4)
         for upstream in ((True, False) if schedule == "1F1B" else (True,))]


@pytest.mark.parametrize("schedule,recompute,stages,upstream", CASES)
def test_rewrite_every_stage(schedule, recompute, stages, upstream):
    with paddle.pir_utils.OldIrGuard():
        for stage in range(stages):
            program = build_pipeline_program(stage, stages=stages, schedule=schedule, recompute=recompute,
                                             branches=2, upstream_send_sync_opt=upstream)
            block = program.global_block()
            check_send_lifetimes(program)  # stock programs are sound
            sends = len(forward_sends(block))
            assert sends == (0 if stage == stages - 1 else 2)
            syncs, calc = _waits(block)
            upstream_nops = sum(op.type == "nop" for op in block.ops)
            if schedule == "1F1B":
                assert (syncs, calc, upstream_nops) == ((0, 0, sends) if upstream else (sends, 0, 0))
            else:
                assert (syncs, calc, upstream_nops) == (0, sends, 0)
            core = _core_ops(program)

            with count_syncs() as counts:
                result = apply_pipeline_send_wait(program)
            assert counts.total == (1 if sends else 0)
            assert len(result.removed_syncs) == syncs and len(result.async_sends) == calc
            assert result.removed_upstream_nops == upstream_nops and len(result.nops) == sends
            assert _waits(block) == (0, 0)
            _check_rewritten(program)
            assert _core_ops(program) == core  # nothing else moved or changed
            assert check_send_lifetimes(program) == sends

            before = program_signature(program)
            again = apply_pipeline_send_wait(program)
            assert not again.changed and program_signature(program) == before  # idempotent


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


def test_rejects_non_program():
    with pytest.raises(TypeError, match="legacy paddle.static.Program"):
        apply_pipeline_send_wait(object())
    with pytest.raises(TypeError, match="legacy paddle.static.Program"):
        check_send_lifetimes(object())


def test_meta_optimizer_registered_and_reversible():
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    assert "PipelineSendWaitOptimizer" in factory.meta_optimizer_names
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    try:
        assert "PipelineSendWaitOptimizer" not in factory.meta_optimizer_names
        assert not hasattr(factory, "PipelineSendWaitOptimizer")
    finally:
        paddle_hybrid.install(config)
    assert "PipelineSendWaitOptimizer" in factory.meta_optimizer_names


def _fleet(stage, stages, schedule, recompute, uninstall):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fleet_pipeline_script.py"), str(stage), str(stages), schedule,
         str(int(recompute)), str(int(uninstall))],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("stage,stages,schedule,recompute", [(0, 2, "F-then-B", True), (1, 3, "1F1B", False)])
def test_fleet_strategy_pipeline(stage, stages, schedule, recompute):
    out = _fleet(stage, stages, schedule, recompute, uninstall=False)
    types = [op["type"] for op in out["ops"]]
    assert "PipelineSendWaitOptimizer" in out["registered"]
    sends = [op for op in out["ops"] if op["type"] == "send_v2" and op["role"] == 0]
    assert sends and all(op["use_calc_stream"] is False for op in sends)
    for send in sends:
        name = send["inputs"][0]
        i = next(i for i, op in enumerate(out["ops"]) if op["type"] == ops.NOP_OP and op["inputs"] == [name])
        j = i - 1
        while out["ops"][j]["type"] == ops.NOP_OP:
            j -= 1
        assert out["ops"][j]["type"] == "recv_v2" and out["ops"][j]["role"] == 1
        assert j == min(k for k, op in enumerate(out["ops"]) if op["type"] == "recv_v2" and op["role"] == 1)
    assert "nop" not in types
    assert out["checker"] == len(sends)


def test_fleet_without_plugin_is_stock():
    out = _fleet(0, 2, "1F1B", False, uninstall=True)
    types = [op["type"] for op in out["ops"]]
    assert out["registered"] == []
    assert ops.NOP_OP not in types and "nop" in types  # upstream's own 1F1B rewrite
    assert out["checker"] == 1
