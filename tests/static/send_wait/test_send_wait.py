"""Pipeline send-wait rewrite on section programs built by Paddle's
PipelineOptimizer (1F1B and F-then-B, with and without recompute, 2-4 stages)
and through fleet, checked with the lifetime checker (whose own tests are in
test_lifetimes.py); the Paddle pass ``ph_pipeline_send_wait``.

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
from paddle_hybrid.testing.sync_count import count_syncs
from paddle_hybrid.static.send_wait import (apply_pipeline_send_wait, check_send_lifetimes, forward_sends,
                                     matching_backward_recv, phase)
from paddle_hybrid.testing.static_programs import build_pipeline_program, program_signature

from foreign_recv import with_foreign_backward_recv

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
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


def test_pass_keeps_alive_until_a_recv_from_the_send_peer():
    """With a foreign recv first in the backward phase, the pass waits for the first recv of a
    gradient of what it sends (the old pass took the foreign recv)."""
    with paddle.pir_utils.OldIrGuard():
        program, foreign = with_foreign_backward_recv()
        block = program.global_block()
        assert block.ops[matching_backward_recv(block)].output("Out")[0].endswith("@GRAD")
        result = apply_pipeline_send_wait(program)
        assert len(result.nops) == 2
        for _, recv_out in result.nops:
            assert recv_out.endswith("@GRAD"), recv_out
        check_send_lifetimes(program)


def test_rejects_non_program():
    with pytest.raises(TypeError, match="legacy paddle.static.Program"):
        apply_pipeline_send_wait(object())


def test_meta_optimizer_registered_and_reversible():
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    assert "PipelineSendWaitOptimizer" in factory.meta_optimizer_names
    assert factory.PipelineSendWaitOptimizer.__module__ == "paddle_hybrid.static.send_wait.meta_optimizer"
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    try:
        assert "PipelineSendWaitOptimizer" not in factory.meta_optimizer_names
        assert not hasattr(factory, "PipelineSendWaitOptimizer")
    finally:
        paddle_hybrid.install(config)
    assert "PipelineSendWaitOptimizer" in factory.meta_optimizer_names


def test_paddle_pass_equals_the_function_and_goes_with_uninstall():
    """``new_pass("ph_pipeline_send_wait")`` through Paddle's PassManager gives the program the
    plain function gives; uninstalling the send_wait component unregisters it."""
    from paddle.distributed.passes import PassManager, new_pass

    with paddle.pir_utils.OldIrGuard():
        by_function = build_pipeline_program(0, stages=3, schedule="F-then-B", branches=2)
        by_pass = build_pipeline_program(0, stages=3, schedule="F-then-B", branches=2)
        assert program_signature(by_function) == program_signature(by_pass)
        expected = apply_pipeline_send_wait(by_function)
        manager = PassManager([new_pass("ph_pipeline_send_wait")])
        context = manager.apply([by_pass], [paddle.static.Program()])
    assert manager.names == ["ph_pipeline_send_wait"]
    assert context.get_attr("ph_pipeline_send_wait").nops == expected.nops and expected.changed
    assert program_signature(by_pass) == program_signature(by_function)
    with pytest.raises(ValueError, match="takes no attributes"):
        new_pass("ph_pipeline_send_wait", {"schedule": "1F1B"}).apply([by_pass], [None])
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component("send_wait")
    try:
        with pytest.raises(AssertionError, match="not registered"):
            new_pass("ph_pipeline_send_wait")
    finally:
        paddle_hybrid.install_component("send_wait", config)
    assert new_pass("ph_pipeline_send_wait").name == "ph_pipeline_send_wait"


def _fleet(stage, stages, schedule, recompute, uninstall):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fleet_pipeline_script.py"), str(stage), str(stages), schedule,
         str(int(recompute)), str(int(uninstall))],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
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
