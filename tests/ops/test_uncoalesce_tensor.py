"""paddle_hybrid.ops.uncoalesce_tensor: the copy back from a fused buffer,
in dygraph, legacy static, PIR, and in a legacy program translated to PIR
(where paddle_hybrid.static.fused_allreduce.pir_repair repairs Paddle's translation of in-place
vector outputs and points later readers at the op's results)."""
import numpy as np
import paddle
import pytest

from paddle_hybrid import ops
from paddle_hybrid.static.fused_allreduce.pir_repair import translate_with_repair


@pytest.mark.parametrize("use_align,align_size", [(False, -1), (True, -1), (True, 64)])
def test_dygraph_inverse_of_coalesce(use_align, align_size):
    src = [paddle.to_tensor(np.arange(6, dtype="float32").reshape(2, 3)), paddle.full([5], 7.0), paddle.full([], 2.0)]
    _, fused = ops.coalesce_tensor(src, copy_data=True, use_align=use_align, align_size=align_size)
    other = fused * 10.0  # a different buffer with the same layout
    dst = [paddle.zeros([2, 3]), paddle.zeros([5]), paddle.zeros([])]
    ptrs = [t.data_ptr() for t in dst]
    out = ops.uncoalesce_tensor(other, dst, use_align=use_align, align_size=align_size)
    assert all(o is d for o, d in zip(out, dst))
    assert [t.data_ptr() for t in dst] == ptrs  # written in place
    np.testing.assert_array_equal(dst[0].numpy(), 10 * np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(dst[1].numpy(), np.full(5, 70.0))
    np.testing.assert_array_equal(dst[2].numpy(), np.array(20.0))


def test_dygraph_views_are_left_alone():
    a, b = paddle.ones([3]), paddle.full([2], 2.0)
    _, fused = ops.coalesce_tensor([a, b], copy_data=True)
    fused.scale_(3.0)
    ops.uncoalesce_tensor(fused, [a, b])  # same addresses: nothing to copy
    np.testing.assert_array_equal(a.numpy(), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(b.numpy(), [6.0, 6.0])


def test_pir_program_gives_readers_the_fused_values():
    paddle.enable_static()
    main = paddle.static.Program()
    with paddle.static.program_guard(main):
        x = paddle.static.data("x", [2, 3], "float32")
        y = paddle.static.data("y", [5], "float32")
        x1, y1 = x * 1.0, y * 1.0
        fused = paddle.arange(11, dtype="float32")
        xo, yo = ops.uncoalesce_tensor(fused, [x1, y1], use_align=False)
        ry = yo * 1.0
    exe = paddle.static.Executor(paddle.CPUPlace())
    rx, ry = exe.run(main, feed={"x": np.zeros([2, 3], "float32"), "y": np.zeros([5], "float32")},
                     fetch_list=[xo, ry])
    np.testing.assert_array_equal(rx, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(ry, np.arange(6, 11))


def _legacy_roundtrip_program():
    """coalesce -> scale the fused buffer -> uncoalesce -> read every tensor."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 3], "float32")
        y = paddle.static.data("y", [4], "float32")
        z = paddle.static.data("z", [3], "float32")
        a, b, c = paddle.scale(x, 1.0), paddle.scale(y, 1.0), paddle.scale(z, 1.0)
        _, fused = ops.coalesce_tensor([a, b, c], copy_data=True, use_align=False)
        paddle.assign(paddle.scale(fused, 10.0), fused)
        ops.uncoalesce_tensor(fused, [a, b, c], use_align=False)
        reads = [paddle.scale(t, 1.0) for t in (a, b, c)]
    return main, reads


FEED = {"x": np.arange(6, dtype="float32").reshape(2, 3), "y": np.arange(4, dtype="float32") + 100,
        "z": np.arange(3, dtype="float32") - 5}


def _want():
    return [10 * FEED["x"], 10 * FEED["y"], 10 * FEED["z"]]


def test_legacy_static_executor():
    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main, reads = _legacy_roundtrip_program()
        types = [op.type for op in main.global_block().ops]
        assert ops.UNCOALESCE_OP in types
        exe = paddle.static.Executor(paddle.CPUPlace())
        got = exe.run(main, feed=FEED, fetch_list=reads)
    for g, w in zip(got, _want()):
        np.testing.assert_array_equal(g, w)


def test_translated_to_pir_every_element_reaches_later_readers():
    """Paddle's translation binds only the first name to the op, so readers of
    the 2nd and 3rd tensors would read the values from before it, with no
    data dependency ordering them after the write.  After the repair every
    later reader reads one of the op's results."""
    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main, reads = _legacy_roundtrip_program()
        names = [r.name for r in reads]
    prog, mapping = translate_with_repair(main)
    block_ops = prog.global_block().ops
    (k,) = [i for i, op in enumerate(block_ops) if op.name() == f"custom_op.{ops.UNCOALESCE_OP}_"]
    readers = [op for op in block_ops[k + 1:] if op.name() == "pd_op.scale"]
    assert len(readers) == 3
    for op in readers:
        split = op.operand_source(0).get_defining_op()
        assert split.name() == "builtin.split"
        assert split.operand_source(0).get_defining_op().id() == block_ops[k].id()
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.pir_utils.IrGuard():
        got = exe.run(prog, feed=FEED, fetch_list=[mapping[n][-1] for n in names])
    for g, w in zip(got, _want()):
        np.testing.assert_array_equal(g, w)


def test_errors():
    fused = paddle.zeros([8])
    with pytest.raises(ValueError, match="empty list"):
        ops.uncoalesce_tensor(fused, [])
    with pytest.raises(ValueError, match="tensor 1 is int32 but the fused buffer is float32"):
        ops.uncoalesce_tensor(fused, [paddle.zeros([2]), paddle.zeros([2], dtype="int32")])
    with pytest.raises(ValueError, match="not a positive multiple"):
        ops.uncoalesce_tensor(fused, [paddle.zeros([2])], align_size=6)
    with pytest.raises(Exception, match="past the fused buffer"):
        ops.uncoalesce_tensor(fused, [paddle.zeros([5]), paddle.zeros([5])], use_align=False)
