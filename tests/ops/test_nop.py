"""paddle_hybrid.ops.nop: in place, same data pointer and values, every dtype,
in dygraph, legacy static programs and PIR."""
import numpy as np
import paddle
import pytest

from paddle_hybrid import ops

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]


def _values(dtype):
    base = np.arange(6).reshape(2, 3)
    if dtype == "bool":
        return paddle.to_tensor(base % 2 == 0)
    return paddle.to_tensor(base.astype("float32")).astype(dtype)


def _np(t):
    return t.astype("float32").numpy() if t.dtype in (paddle.float16, paddle.bfloat16) else t.numpy()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dygraph_same_pointer_and_values(dtype):
    x, y = _values(dtype), paddle.ones([4], dtype=dtype)
    px, py, vx = x.data_ptr(), y.data_ptr(), _np(x).copy()
    rx, ry = ops.nop(x, y)
    assert rx is x and ry is y
    assert x.data_ptr() == px and y.data_ptr() == py
    np.testing.assert_array_equal(_np(x), vx)
    assert ops.nop(x) is x


def test_dygraph_on_parameter_requiring_grad():
    w = paddle.create_parameter([3], "float32")
    before = w.numpy().copy()
    assert ops.nop(w) is w
    assert not w.stop_gradient  # flag restored
    np.testing.assert_array_equal(w.numpy(), before)


def _persistable_program(dtype, mode_guard):
    """A persistable variable filled by the startup program; main runs nop on it."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with mode_guard(), paddle.static.program_guard(main, startup):
        w = paddle.static.create_global_var([2, 3], 1.0, dtype, persistable=True, name=f"w_{dtype}")
        out = ops.nop(w)
    return main, startup, w, out


@pytest.mark.parametrize("dtype", DTYPES)
def test_legacy_static_in_place(dtype):
    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main, startup, w, out = _persistable_program(dtype, paddle.pir_utils.OldIrGuard)
        ops_ = main.global_block().ops
        assert [o.type for o in ops_] == [ops.NOP_OP]
        assert ops_[0].input(ops.NOP_IN) == [w.name] == ops_[0].output(ops.NOP_OUT)
        scope = paddle.static.Scope()
        exe = paddle.static.Executor(paddle.CPUPlace())
        with paddle.static.scope_guard(scope):
            exe.run(startup)
            t = scope.find_var(w.name).get_tensor()
            ptr, before = t._ptr(), np.array(t)
            exe.run(main)
            t = scope.find_var(w.name).get_tensor()
            assert t._ptr() == ptr
            np.testing.assert_array_equal(np.array(t), before)


def test_legacy_insert_by_type_without_sync():
    """Passes insert the op by its type; it must survive a later sync."""
    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [4], "float32")
            y = paddle.scale(x, 2.0)
            z = paddle.scale(y, 1.0)
        block = main.global_block()
        block._insert_op_without_sync(1, type=ops.NOP_OP, inputs={ops.NOP_IN: [y]}, outputs={ops.NOP_OUT: [y]})
        block._sync_with_cpp()
        assert [o.type for o in block.ops] == ["scale", ops.NOP_OP, "scale"]
        exe = paddle.static.Executor(paddle.CPUPlace())
        (rz,) = exe.run(main, feed={"x": np.arange(4, dtype="float32")}, fetch_list=[z])
    np.testing.assert_array_equal(rz, np.arange(4) * 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pir_in_place_values(dtype):
    want = _np(_values(dtype)).astype("float32")
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 3], "float32")
        y = paddle.cast(x, dtype)
        out = ops.nop(y)
        read = paddle.cast(out, "float32")
    names = [op.name() for op in main.global_block().ops]
    assert "custom_op.ph_nop_" in names  # the in-place form
    exe = paddle.static.Executor(paddle.CPUPlace())
    (r,) = exe.run(main, feed={"x": want}, fetch_list=[read])
    np.testing.assert_array_equal(r, want)


def test_pir_same_data_pointer():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        w = paddle.static.create_parameter([2, 3], "float32", name="pir_w",
                                           default_initializer=paddle.nn.initializer.Constant(1.5))
        out = ops.nop(w)
        read = out * 1.0
    scope = paddle.static.Scope()
    exe = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        exe.run(startup)
        ptr = scope.find_var("pir_w").get_tensor()._ptr()
        (r,) = exe.run(main, fetch_list=[read])
        assert scope.find_var("pir_w").get_tensor()._ptr() == ptr
    np.testing.assert_array_equal(r, np.full([2, 3], 1.5, "float32"))


def test_errors():
    with pytest.raises(ValueError, match="empty list"):
        ops.nop()
    with pytest.raises(TypeError, match="not a Paddle tensor"):
        ops.nop(np.ones(3))
    sp = paddle.sparse.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], [2, 2])
    with pytest.raises(TypeError, match="not dense"):
        ops.nop(sp)
