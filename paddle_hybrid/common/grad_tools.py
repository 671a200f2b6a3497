"""Gradients that must stay views of a fused buffer: the few operations every such scheme needs.

Fleet's sharding V2 comm buffers and the plugin's gradient buckets both make each parameter's
gradient a view of one fused buffer, so that one collective reduces them all.  Paddle breaks
such a view in two ways, on any device:

* ``Tensor.clear_gradient(set_to_zero=True)`` (what ``Optimizer.clear_grad()`` and
  ``Layer.clear_gradients()`` call) zeroes the gradient but marks it "fake empty": the next
  backward *assigns* a new tensor to ``.grad`` instead of accumulating into the view, and the
  buffer keeps zeros;
* ``set_to_zero=False``, or any assignment to ``.grad``, drops the view outright.

So gradients of a fused buffer are zeroed in place (:func:`zero_in_place`,
:func:`zero_grad_in_place`), and before a buffer is reduced every gradient that is not its view
any more (:func:`points_at`) has its values copied back into its slot (:func:`refill`) before
the scheme makes it a view again (how it does that is its own business).
"""
from __future__ import annotations

__all__ = ["current_grad", "divide_fused_fsdp_grads", "points_at", "refill", "zero_in_place", "zero_grad_in_place"]


def current_grad(param, main_grad: bool = False):
    """The gradient tensor backward left on ``param`` (``param.main_grad`` with fleet's
    main_grad recipe), or None when there is none or it holds no memory (after
    ``clear_gradient(False)`` or ``_clear()``): callers then treat it as zeros."""
    grad = getattr(param, "main_grad", None) if main_grad else param._grad_ivar()
    if grad is None or not grad._is_initialized():
        return None
    return grad


def points_at(grad, address: int) -> bool:
    """Whether ``grad`` (a tensor or None) starts at byte ``address``: a view of a fused buffer
    is recognised by its data pointer, since a replaced gradient is a different allocation."""
    return grad is not None and grad._is_initialized() and grad.data_ptr() == address


def refill(slot, grad) -> None:
    """Write ``grad``'s values (reshaped, cast to the slot's dtype) into ``slot`` in place, or
    zeros when ``grad`` is None: what a gradient that backward put into a fresh tensor, or that
    was dropped, contributes to the buffer ``slot`` is part of."""
    import paddle

    with paddle.no_grad():
        if grad is None:
            slot.zero_()
        else:
            slot.copy_(grad.reshape(slot.shape).astype(slot.dtype), False)


def zero_in_place(tensors) -> None:
    """Zero every tensor of ``tensors`` (None entries skipped) without replacing it or marking
    it "fake empty", so views of it keep receiving the next backward's accumulation."""
    import paddle

    with paddle.no_grad():
        for t in tensors:
            if t is not None and t._is_initialized():
                t.zero_()


def zero_grad_in_place(param) -> None:
    """Zero ``param.grad`` in place, keeping the tensor (and so any buffer it is a view of);
    unlike ``param.clear_gradient()`` the next backward accumulates into it."""
    zero_in_place([current_grad(param)])


def divide_fused_fsdp_grads(fsdp, divisor: float) -> None:
    """Divide the gradients Paddle's fused FSDP (``FullyShardFusion``) holds for the optimizer by
    ``divisor``: its pending reduce-scatters are completed first, then every trainable group's
    fused gradient buffer is scaled in place (the optimizer reads those buffers, not ``.grad``)."""
    import paddle

    fsdp.comm_manager.finish_grads_sync()
    with paddle.no_grad():
        for group in fsdp.comm_manager.buffer_manager.buffer_groups:
            if group.grads_buffer is not None and group.params_buffer.trainable:
                group.grads_buffer.data_buffer.scale_(1.0 / divisor)
