"""paddle_hybrid.ops.coalesce_tensor against Paddle's built-in coalesce_tensor.

Layout oracle: the built-in op on CPU only has float32/float64/int32 kernels,
but its `size_of_dtype` attribute lets it lay out any element size, so every
dtype's offsets and fused numel come from the built-in itself.  Values come
from NumPy (the inputs for copy_data, the constant for set_constant).
"""
import itertools

import numpy as np
import paddle
import pytest

from paddle_hybrid import ops

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]
# A built-in dtype with a CPU kernel to lay out each element size.
_BASE = {1: ("float32", 4), 2: ("float32", 4), 4: ("float32", 4), 8: ("float64", 8)}


def _np_values(dtype, shape, rng):
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype in ("int32", "int64"):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    if dtype == "float64":
        return rng.standard_normal(shape)
    return rng.standard_normal(shape).astype("float32")  # paddle converts for float16/bfloat16


def _tensor(dtype, arr):
    return paddle.to_tensor(arr).astype(dtype) if dtype in ("float16", "bfloat16") else paddle.to_tensor(arr)


def _as_np(t):
    if t.dtype in (paddle.float16, paddle.bfloat16):
        return t.astype("float32").numpy()
    return t.numpy()


def builtin_layout(shapes, elem, use_align, align_size):
    """Offsets (elements) and fused numel of the built-in op for `elem`-byte elements."""
    base_dtype, base_size = _BASE[elem]
    ins = [paddle.zeros(s, dtype=base_dtype) for s in shapes]
    outs, fused = paddle._C_ops.coalesce_tensor(
        ins, getattr(paddle, base_dtype), False, False, False, 0.0, use_align, align_size, elem, [], []
    )
    offsets = [(o.data_ptr() - fused.data_ptr()) // base_size for o in outs]
    return offsets, int(fused.shape[0])


def plugin_layout(outs, fused, elem):
    return [(o.data_ptr() - fused.data_ptr()) // elem for o in outs], int(fused.shape[0])


SHAPES = [[[3, 5]], [[], [7]], [[2, 3], [1], [4, 4, 2], []], [[1025], [3], [33, 2]]]
CASES = list(itertools.product(DTYPES, [True, False], [-1, 8, 64, 512], range(len(SHAPES))))


@pytest.mark.parametrize("dtype,use_align,align_size,shape_idx", CASES)
def test_layout_and_copy_match_builtin(dtype, use_align, align_size, shape_idx):
    rng = np.random.default_rng(shape_idx * 1000 + align_size + 1)
    shapes = SHAPES[shape_idx]
    elem = ops.element_size(dtype)
    arrays = [_np_values(dtype, s, rng) for s in shapes]
    ins = [_tensor(dtype, a) for a in arrays]
    expect_vals = [_as_np(t) for t in ins]
    outs, fused = ops.coalesce_tensor(ins, copy_data=True, use_align=use_align, align_size=align_size)
    want_offsets, want_numel = builtin_layout(shapes, elem, use_align, align_size)
    got_offsets, got_numel = plugin_layout(outs, fused, elem)
    assert got_offsets == want_offsets
    assert got_numel == want_numel
    assert str(fused.dtype).endswith(dtype)
    flat = _as_np(fused)
    for o, off, want, shape in zip(outs, got_offsets, expect_vals, shapes):
        assert list(o.shape) == list(shape)
        np.testing.assert_array_equal(_as_np(o), want)
        n = int(np.prod(shape))
        np.testing.assert_array_equal(flat[off : off + n], want.reshape(-1))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("use_align,align_size", [(True, -1), (True, 64), (False, -1)])
def test_set_constant_matches_builtin_values(dtype, use_align, align_size):
    shapes = [[2, 3], [5], []]
    ins = [paddle.zeros(s, dtype=dtype) for s in shapes]
    ref_in = [paddle.zeros(s, dtype=dtype) for s in shapes]
    outs, fused = ops.coalesce_tensor(ins, set_constant=True, constant=3.0, use_align=use_align,
                                      align_size=align_size)
    ref_outs, ref_fused = paddle._C_ops.coalesce_tensor(
        ref_in, getattr(paddle, dtype), False, True, False, 3.0, use_align, align_size, -1, [], []
    )
    np.testing.assert_array_equal(fused.numpy(), ref_fused.numpy())
    for o, r in zip(outs, ref_outs):
        np.testing.assert_array_equal(o.numpy(), r.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_set_constant_every_dtype(dtype):
    outs, fused = ops.coalesce_tensor([paddle.zeros([3, 2], dtype=dtype), paddle.zeros([4], dtype=dtype)],
                                      set_constant=True, constant=1.0)
    want = np.ones(int(fused.shape[0]), dtype=bool if dtype == "bool" else "float32")
    np.testing.assert_array_equal(_as_np(fused).astype(want.dtype), want)
    assert all(_as_np(o).astype(want.dtype).all() for o in outs)


def test_padding_is_zero_with_copy_data():
    outs, fused = ops.coalesce_tensor([paddle.full([3], 7.0), paddle.full([2], 5.0)], copy_data=True,
                                      align_size=64)
    flat = fused.numpy()
    assert flat.shape == (32,)
    np.testing.assert_array_equal(flat[:3], 7.0)
    np.testing.assert_array_equal(flat[3:16], 0.0)
    np.testing.assert_array_equal(flat[16:18], 5.0)
    np.testing.assert_array_equal(flat[18:], 0.0)


def test_empty_tensor_takes_no_space_where_builtin_refuses():
    a, e, b = paddle.ones([3]), paddle.ones([0]), paddle.full([2], 2.0)
    outs, fused = ops.coalesce_tensor([a, e, b], copy_data=True, align_size=16)
    assert int(fused.shape[0]) == 8
    assert list(outs[1].shape) == [0]
    np.testing.assert_array_equal(fused.numpy()[4:6], [2.0, 2.0])
    with pytest.raises(Exception):
        paddle._C_ops.coalesce_tensor([paddle.ones([0])], paddle.float32, True, False, False, 0.0, True,
                                      -1, -1, [], [])


def test_dtype_argument_reinterprets_like_builtin():
    ins = [paddle.zeros([3], dtype="int32"), paddle.zeros([5], dtype="float64")]
    outs, fused = ops.coalesce_tensor(ins, dtype="float32", set_constant=True, constant=2.0, use_align=False)
    assert fused.dtype == paddle.float32 and int(fused.shape[0]) == 8
    assert all(o.dtype == paddle.float32 for o in outs)
    np.testing.assert_array_equal(outs[1].numpy(), np.full([5], 2.0, "float32"))


# ----------------------------------------------------------------------------- aliasing
def test_dygraph_alias_both_ways():
    x, y = paddle.ones([2, 3]), paddle.full([4], 2.0)
    outs, fused = ops.coalesce_tensor([x, y], copy_data=True)
    assert outs[0] is x and outs[1] is y
    off = (y.data_ptr() - fused.data_ptr()) // 4
    # write through the fused buffer -> seen by the views
    fused.scale_(10.0)
    np.testing.assert_array_equal(x.numpy(), np.full([2, 3], 10.0))
    np.testing.assert_array_equal(y.numpy(), np.full([4], 20.0))
    # write through a view -> seen by the fused buffer
    paddle.assign(paddle.full([4], -1.0), output=y)
    np.testing.assert_array_equal(fused.numpy()[off : off + 4], np.full([4], -1.0))
    x.scale_(0.5)
    np.testing.assert_array_equal(fused.numpy()[:6], np.full([6], 5.0))


def test_legacy_static_alias_both_ways():
    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            a = paddle.static.data("a", [2, 3], "float32")
            b = paddle.static.data("b", [5], "float32")
            a2, b2 = paddle.scale(a, 1.0), paddle.scale(b, 1.0)
            (va, vb), fused = ops.coalesce_tensor([a2, b2], copy_data=True)
            # fused -> views
            paddle.assign(paddle.scale(fused, 3.0), fused)
            read_a = paddle.scale(va, 1.0)
            # view -> fused
            paddle.assign(paddle.full([5], -1.0), vb)
            read_fused = paddle.scale(fused, 1.0)
        types = [op.type for op in main.global_block().ops]
        assert ops.COALESCE_OP in types and "coalesce_tensor" not in types
        exe = paddle.static.Executor(paddle.CPUPlace())
        ra, rf = exe.run(main, feed={"a": np.ones([2, 3], "float32"), "b": np.full([5], 2.0, "float32")},
                         fetch_list=[read_a, read_fused])
    np.testing.assert_array_equal(ra, np.full([2, 3], 3.0))
    np.testing.assert_array_equal(rf[:6], np.full([6], 3.0))
    np.testing.assert_array_equal(rf[1024:1029], np.full([5], -1.0))


def test_pir_raises_documented_error():
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        a = paddle.static.data("a", [2, 3], "float32")
        with pytest.raises(ops.PirAliasingError, match="cannot make its outputs alias"):
            ops.coalesce_tensor([a], copy_data=True)


def test_pir_program_runs_the_op_with_copy_semantics():
    """Built directly in PIR (through the op, not the aliasing wrapper) the op
    runs: the fused buffer holds the packed values with the built-in layout;
    the outputs keep the input values and do NOT alias (documented)."""
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        a = paddle.static.data("a", [2, 3], "float32")
        b = paddle.static.data("b", [5], "float32")
        a2, b2 = a * 1.0, b * 1.0
        res = paddle._C_ops._run_custom_op(ops.COALESCE_OP, [a2, b2], "float32", True, False, 0.0, True, 64)
        (oa, ob), fused = res[:-1], res[-1]
        scaled = paddle._C_ops.scale_(fused, 3.0, 0.0, True)
        read_a = oa * 1.0
    exe = paddle.static.Executor(paddle.CPUPlace())
    ra, rf = exe.run(main, feed={"a": np.ones([2, 3], "float32"), "b": np.full([5], 2.0, "float32")},
                     fetch_list=[read_a, scaled])
    np.testing.assert_array_equal(rf, np.r_[np.full(6, 3.0), np.zeros(10), np.full(5, 6.0), np.zeros(11)])
    np.testing.assert_array_equal(ra, np.ones([2, 3]))  # copy semantics: not a view under PIR


# ----------------------------------------------------------------------------- bad input
def test_error_empty_list():
    with pytest.raises(ValueError, match="empty list"):
        ops.coalesce_tensor([])


def test_error_mixed_dtypes_without_dtype():
    with pytest.raises(ValueError, match="tensor 1 is int32 but tensor 0 is float32.*dtype="):
        ops.coalesce_tensor([paddle.ones([2]), paddle.ones([2], dtype="int32")])


def test_error_mixed_dtypes_in_the_kernel():
    with pytest.raises(Exception, match="pass `dtype` explicitly"):
        paddle._C_ops._run_custom_op(ops.COALESCE_OP, [paddle.ones([2]), paddle.ones([2], dtype="int64")],
                                     "", True, False, 0.0, True, -1)


def test_error_copy_data_with_other_dtype():
    with pytest.raises(ValueError, match="cast it first"):
        ops.coalesce_tensor([paddle.ones([2]), paddle.ones([2], dtype="int32")], dtype="float32",
                            copy_data=True)


def test_error_uninitialised_input_with_copy_data():
    t = paddle.base.core.eager.Tensor(paddle.float32, [2, 3], "uninit", paddle.base.core.VarDesc.VarType.DENSE_TENSOR,
                                      False)
    assert not t._is_initialized()
    with pytest.raises(ValueError, match="tensor 1 is not initialised but copy_data=True"):
        ops.coalesce_tensor([paddle.ones([2, 3]), t], copy_data=True)


def test_error_non_dense_tensor():
    sp = paddle.sparse.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], [2, 2])
    with pytest.raises(TypeError, match="not dense"):
        ops.coalesce_tensor([paddle.ones([2]), sp])


@pytest.mark.parametrize("align_size,dtype", [(0, "float32"), (6, "float32"), (-2, "float32"), (12, "float64"),
                                              (3, "float16")])
def test_error_bad_align_size(align_size, dtype):
    with pytest.raises(ValueError, match="not a positive multiple of the element size"):
        ops.coalesce_tensor([paddle.ones([2], dtype=dtype)], align_size=align_size)


def test_error_bad_align_size_in_the_kernel():
    with pytest.raises(Exception, match="not a positive multiple of the element size"):
        paddle._C_ops._run_custom_op(ops.COALESCE_OP, [paddle.ones([2])], "", True, False, 0.0, True, 6)


def test_builtin_ops_still_registered_and_unchanged():
    """The plugin's ops coexist with the built-ins of the same purpose."""
    assert {"ph_nop", "ph_coalesce_tensor"} <= set(ops.REGISTERED_OPS)
    assert not {"nop", "coalesce_tensor"} & set(ops.REGISTERED_OPS)
    outs, fused = paddle._C_ops.coalesce_tensor([paddle.ones([3])], paddle.float32, True, False, False, 0.0, True,
                                                -1, -1, [], [])
    np.testing.assert_array_equal(fused.numpy()[:3], np.ones(3))
