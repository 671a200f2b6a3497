"""paddle_hybrid.common.grad_tools: the gradient helpers shared by the sharding V2 fix and (at merge) the
gradient buckets; and the Paddle behaviour they exist for."""
import numpy as np

import paddle
from paddle_hybrid.common import grad_tools


def _param_with_grad(values):
    p = paddle.create_parameter([len(values)], "float32")
    (p * paddle.to_tensor(values, dtype="float32")).sum().backward()
    return p


def _view_grad(p, buffer, start):
    """Make ``p``'s gradient a view of ``buffer[start:start + numel]`` (what sharding V2 and the
    buckets do)."""
    view = buffer._slice(start, start + p._numel())
    p._set_grad_ivar(paddle.empty_like(view))
    view._share_buffer_to(p._grad_ivar())
    return buffer.data_ptr() + start * buffer.element_size()


def test_current_grad_none_when_absent_or_without_memory():
    p = paddle.create_parameter([3], "float32")
    assert grad_tools.current_grad(p) is None
    (p * 2).sum().backward()
    np.testing.assert_array_equal(grad_tools.current_grad(p).numpy(), [2, 2, 2])
    p.clear_gradient(False)  # drops the memory
    assert grad_tools.current_grad(p) is None
    p.main_grad = paddle.ones([3])
    np.testing.assert_array_equal(grad_tools.current_grad(p, main_grad=True).numpy(), [1, 1, 1])


def test_paddle_replaces_a_fake_empty_grad_and_zero_grad_in_place_does_not():
    """Why the helpers exist: after ``clear_gradient(True)`` the next backward puts the gradient
    into a new tensor (the buffer keeps zeros); after :func:`zero_grad_in_place` it accumulates
    into the view."""
    buffer = paddle.zeros([8])
    p = _param_with_grad([1.0, 2.0, 3.0])
    address = _view_grad(p, buffer, 2)
    assert grad_tools.points_at(p._grad_ivar(), address)

    p.clear_gradient(True)
    (p * paddle.to_tensor([1.0, 2.0, 3.0])).sum().backward()
    assert not grad_tools.points_at(p._grad_ivar(), address)  # Paddle's: a fresh tensor
    np.testing.assert_array_equal(buffer.numpy(), np.zeros(8))

    address = _view_grad(p, buffer, 2)
    grad_tools.zero_grad_in_place(p)
    (p * paddle.to_tensor([1.0, 2.0, 3.0])).sum().backward()
    assert grad_tools.points_at(p._grad_ivar(), address)       # still the view ...
    np.testing.assert_array_equal(buffer.numpy(), [0, 0, 1, 2, 3, 0, 0, 0])  # ... holding the gradient


def test_refill_copies_into_the_slot_or_zeroes_it():
    buffer = paddle.full([6], 9.0)
    slot = buffer._slice(1, 4)
    grad_tools.refill(slot, paddle.to_tensor([[1.0, 2.0, 3.0]], dtype="float64"))  # reshaped, cast
    np.testing.assert_array_equal(buffer.numpy(), [9, 1, 2, 3, 9, 9])
    grad_tools.refill(buffer._slice(4, 6), None)
    np.testing.assert_array_equal(buffer.numpy(), [9, 1, 2, 3, 0, 0])


def test_zero_in_place_keeps_the_tensors():
    a, b = paddle.ones([2]), paddle.ones([3])
    ptrs = (a.data_ptr(), b.data_ptr())
    grad_tools.zero_in_place([a, None, b])
    assert (a.data_ptr(), b.data_ptr()) == ptrs
    assert float(a.abs().sum()) == 0 and float(b.abs().sum()) == 0


def test_points_at():
    t = paddle.ones([4])
    assert grad_tools.points_at(t, t.data_ptr())
    assert not grad_tools.points_at(t, t.data_ptr() + 4)
    assert not grad_tools.points_at(None, t.data_ptr())
