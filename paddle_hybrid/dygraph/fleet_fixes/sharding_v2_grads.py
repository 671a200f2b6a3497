"""Sharding stage 1 V2 (``sharding_configs.split_param``): gradients reach the reduce-scatter,
and sharding x data parallel all-reduces every slice from step 1.

Both defects train silently wrong (no error).  Seen on CPU/gloo, where the plugin first ran
them; nothing in the code involved depends on the device (Python bookkeeping and
``Tensor.clear_gradient``, whose "fake empty" marking is device-independent), so they are fixed
wherever fleet runs.  Both only show with ``.grad`` gradients (not fleet's ``main_grad``
recipe), and the second one with a data-parallel degree above 1.

1. ``DygraphShardingOptimizerV2.clear_grad`` calls ``Tensor.clear_gradient(True)``, which zeroes
   a gradient but marks it "fake empty": the next backward *replaces* it instead of
   accumulating into the comm buffer it is a view of, so from step 2 on the reduce-scatter sends
   zeros (seen: parameters 0.05 off the single-process run after 5 Adam steps).  Patch: the
   comm buffers are zeroed in place; parameters whose gradient is not such a view get Paddle's
   treatment.
2. ``DygraphShardingOptimizerV2.reduce_gradients``: a gradient replaced anyway
   (``Layer.clear_gradients()``, ``Tensor.clear_gradient()``, the same "fake empty" effect) is
   copied back into its buffer slice and made a view again before the buffer is reduced
   (counted in the optimizer's ``_ph_grads_relinked``).
3. ``DygraphShardingOptimizerV2.filter_parameters`` picks the slice parameters the DP group
   all-reduces, but slices get storage only later in ``step()``: on step 1 none qualifies and
   sharding x dp updates with the sharding group's gradient only (seen: 0.02 off after one
   step).  Patch: assign the slices first (``_assign_slice_grad``; ``step()`` repeats it, which
   is idempotent).  Not with ``release_gradients``, whose slices are re-created every step.
"""
from __future__ import annotations

import functools

from ...common import grad_tools

__all__ = ["apply", "RELINKED_ATTR"]

RELINKED_ATTR = "_ph_grads_relinked"
"""Optimizer attribute: how many gradients were put back into their comm buffers so far."""


# ---------------------------------------------------------------------------
# where a parameter's gradient belongs in a comm buffer
# ---------------------------------------------------------------------------

def _slot(buffer, param):
    """The slice of ``buffer.grad_storage`` that is ``param``'s gradient."""
    view = buffer._sharding_param_grad_view[param.name]
    return buffer.grad_storage._slice(view._index, view._index + param._numel())


def _view_intact(buffer, param) -> bool:
    """Whether ``param``'s gradient is still the slice of ``buffer.grad_storage`` it was given."""
    view = buffer._sharding_param_grad_view[param.name]
    address = buffer.grad_storage.data_ptr() + view._index * buffer.grad_storage.element_size()
    return grad_tools.points_at(grad_tools.current_grad(param, buffer.use_main_grad), address)


def relink_grads(opt) -> int:
    """Copy every gradient that backward put in a fresh tensor (or that was dropped) back into
    its comm buffer slice and make it a view again; returns how many were relinked."""
    relinked = 0
    for buffer in opt._comm_buffer_list:
        if buffer.grad_storage is None:  # release_grads: Paddle copies into a new buffer itself
            continue
        for param in buffer.params:
            if _view_intact(buffer, param):
                continue
            grad_tools.refill(_slot(buffer, param), grad_tools.current_grad(param, buffer.use_main_grad))
            buffer._sharding_param_grad_view[param.name]._link_grad_to_buffer()
            relinked += 1
    return relinked


# ---------------------------------------------------------------------------
# the patched methods
# ---------------------------------------------------------------------------

def _make_clear_grad(orig):
    @functools.wraps(orig)
    def clear_grad(self, set_to_zero=True):
        # Zero the comm buffers in place instead of Tensor.clear_gradient(True), whose "fake
        # empty" gradient the next backward replaces (the buffer would keep zeros).
        if not set_to_zero or self.sd_release_grads or not self._comm_buffer_list:
            return orig(self, set_to_zero)
        # phase 1: which gradients are views of a buffer now (zeroing the buffer zeroes them)
        kept, buffers = set(), []
        for buffer in self._comm_buffer_list:
            if buffer.grad_storage is None:
                continue
            kept.update(id(p) for p in buffer.params if _view_intact(buffer, p))
            buffers.append(buffer.grad_storage)
        # phase 2: zero the buffers, and with them every view
        grad_tools.zero_in_place(buffers)
        # phase 3: everything else (not a view, main_grad) gets Paddle's treatment, run on just those
        rest = [p for p in self._parameter_list if id(p) not in kept]
        if rest:
            saved = self._parameter_list
            self._parameter_list = rest
            try:
                orig(self, set_to_zero)
            finally:
                self._parameter_list = saved
        return None

    return clear_grad


def _make_reduce_gradients(orig):
    @functools.wraps(orig)
    def reduce_gradients(self, parameter_list, hcg):
        # A gradient cleared elsewhere comes back from backward as a new tensor: put it into
        # the buffer before the buffer is reduced.
        setattr(self, RELINKED_ATTR, getattr(self, RELINKED_ATTR, 0) + relink_grads(self))
        return orig(self, parameter_list, hcg)

    return reduce_gradients


def _slices_pending(opt) -> bool:
    """A non-empty slice of some parameter whose slice parameter has no storage yet."""
    opt._collect_comm_buffers()
    for buffer in opt._comm_buffer_list:
        for name, view in buffer._sharding_param_grad_view.items():
            if view.has_effective_slice_param and not opt._slice_params[name]._is_initialized():
                return True
    return False


def _make_filter_parameters(orig):
    @functools.wraps(orig)
    def filter_parameters(self, parameter_list, hcg):
        # The slices get storage in step(), after this filter chose what the data-parallel
        # group all-reduces: give them storage and gradients first (idempotent).
        if not self.sd_release_grads and _slices_pending(self):
            self._assign_slice_grad()
        return orig(self, parameter_list, hcg)

    return filter_parameters


def apply(config, patcher) -> None:
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import dygraph_sharding_optimizer as dso
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh

    # --- check everything first ---------------------------------------------------------
    v2 = patcher.require(dso, "DygraphShardingOptimizerV2", "dygraph_sharding_optimizer")
    patcher.require(tfh.ShardingGradView, "_link_grad_to_buffer", "ShardingGradView")
    patcher.check_params(v2.clear_grad, ["self", "set_to_zero"], "DygraphShardingOptimizerV2.clear_grad")
    for name in ("reduce_gradients", "filter_parameters"):
        patcher.check_params(getattr(v2, name), ["self", "parameter_list", "hcg"], f"DygraphShardingOptimizerV2.{name}")
    for name in ("_assign_slice_grad", "_collect_comm_buffers"):
        patcher.require(v2, name, "DygraphShardingOptimizerV2")
    # --- patch ------------------------------------------------------------------------------
    patcher.set(v2, "clear_grad", _make_clear_grad(v2.clear_grad))
    patcher.set(v2, "reduce_gradients", _make_reduce_gradients(v2.reduce_gradients))
    patcher.set(v2, "filter_parameters", _make_filter_parameters(v2.filter_parameters))
