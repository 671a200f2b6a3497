"""The repair of Paddle 3.3.1's legacy->PIR translation of the plugin's vector ops, in the global
block and in control-flow sub-blocks."""
import numpy as np
import paddle
from paddle.pir_utils import OldIrGuard

from paddle_hybrid import ops
from paddle_hybrid.static.fused_allreduce import repair_custom_vector_ops, translate_with_repair


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




def test_repair_reaches_control_flow_sub_blocks():
    """``ph_coalesce_tensor`` inside a conditional block: translated into a ``pd_op.if`` region,
    broken the same way; repaired there and run (the old repair looked at the global block only,
    and the run failed in the custom op's InferShape)."""
    from paddle.static.nn.control_flow import ConditionalBlock

    paddle.enable_static()
    with OldIrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [2, 3], "float32")
            y = paddle.static.data("y", [4], "float32")
            flag = paddle.static.data("flag", [1], "bool")
            out = paddle.static.create_global_var([10], 0.0, "float32", name="out_holder")
            with ConditionalBlock([flag], is_scalar_condition=True).block():
                a, b = paddle.scale(x, 2.0), paddle.scale(y, 3.0)
                _, fused = ops.coalesce_tensor([a, b], copy_data=True, use_align=False)
                paddle.assign(paddle.scale(fused, 1.0), out)
        assert main.num_blocks == 2 and ops.COALESCE_OP in [op.type for op in main.block(1).ops]
        raw = paddle.pir.translate_to_pir(main.desc)
    assert repair_custom_vector_ops(raw) == 1
    assert repair_custom_vector_ops(raw) == 0
    prog, mapping = translate_with_repair(main)
    xv, yv = np.arange(6, dtype="float32").reshape(2, 3), np.arange(4, dtype="float32")
    with paddle.pir_utils.IrGuard():
        (got,) = paddle.static.Executor(paddle.CPUPlace()).run(
            prog, feed={"x": xv, "y": yv, "flag": np.array([True])}, fetch_list=[mapping[out.name][-1]])
    np.testing.assert_array_equal(got, np.concatenate([2 * xv.ravel(), 3 * yv]))
