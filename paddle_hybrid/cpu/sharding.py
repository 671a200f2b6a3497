"""Fleet sharding on CPU/gloo: stage 1 (``sharding_degree``, V1 and V2 with
``sharding_configs.split_param``, tensor fusion, comm overlap, with DP and PP) and
``group_sharded_parallel`` levels ``os``, ``os_g``, ``p_g_os``, with ``save_group_sharded_model``.

1. ``tensor_fusion_helper.get_current_device_type`` asks the place for ``get_device_type()``,
   which ``CPUPlace`` lacks, and its ``alignment`` table has no CPU entry (V2 always, V1 with
   ``tensor_fusion``/``comm_overlap``): "tensor fusion helper now only support
   dict_keys(['gpu', 'npu', 'xpu']), but got device unknown instead".  Patch: "cpu" for a
   CPUPlace, and ``alignment["cpu"] = 64`` bytes (the CPU allocator's own alignment).
2. ``ParamStorage.add_rank_params`` (V1 tensor fusion, group sharded stage 2) moves the fused
   buffer to the device: it clears each parameter and then reads ``param.cpu()``, which on CPU
   is the same memory ("(PreconditionNotMet) Tensor not initialized yet when
   DenseTensor::place() is called"), and ``cvt_to_device`` raises on a CPU build.  Patch: a
   "cpu" storage takes Paddle's own no-conversion path (``convert_gpu=False``).
3. ``DygraphShardingOptimizerV2.clear_grad`` calls ``Tensor.clear_gradient(True)``, which zeroes
   a gradient but marks it "fake empty": the next backward *replaces* it instead of
   accumulating into the comm buffer it is a view of, so from step 2 on the reduce-scatter sends
   zeros (no error; parameters 0.05 off the single-process run after 5 Adam steps).  Patch: the
   comm buffers are zeroed in place; parameters whose gradient is not such a view get the stock
   treatment.
4. ``DygraphShardingOptimizerV2.reduce_gradients``: a gradient replaced anyway
   (``Layer.clear_gradients()``, ``Tensor.clear_gradient()``, the same "fake empty" effect) is
   copied back into its buffer slice and made a view again before the buffer is reduced
   (count in the optimizer's ``_ph_grads_relinked``).
5. ``DygraphShardingOptimizerV2.filter_parameters`` picks the slice parameters the DP group
   all-reduces, but slices get storage only later in ``step()``: on step 1 none qualifies and
   sharding x dp updates with the sharding group's gradient only (no error; 0.02 off after one
   step).  Patch: assign the slices first (``_assign_slice_grad``; ``step()`` repeats it, which
   is idempotent).  Not with ``release_gradients``, whose slices are re-created per step.
6. ``group_sharded_parallel``: "group_sharded_parallel only support gpu, xpu and custom_device
   now"; ``GroupShardedOptimizerStage2`` / ``GroupShardedStage3``: "Only GPU and XPU and
   CustomDevice is supported now"; then ``GroupShardedOptimizerStage2`` reads a device index
   from ``paddle.get_device()`` ("cpu": "IndexError: list index out of range").  Patch: in
   those three modules only, the module-level ``paddle``/``core`` is a view
   (:class:`_ModuleView`) identical to the module except for the queries used there to refuse
   CPU: CPU counts as an accepted device type for ``group_sharded_parallel``'s check, the
   stage 2/3 constructors' build check passes, and stage 2 reads device index 0.  The functions
   themselves are untouched, so a ``group_sharded_parallel`` imported before ``paddle_hybrid``
   is fixed too.
7. ``GroupShardedClipGrad._dygraph_clip`` (``ClipGradByGlobalNorm`` with stage 3, or stage 2
   outside hybrid parallel) reads a device index ("IndexError") and moves the norm to a GPU
   ("ValueError: No available device found.").  Patch: on CPU, the same global norm (sliced
   parameters summed over the group, ``unslice`` ones counted once) without the move.

3 and 5 are not CPU-specific in Paddle's code (seen here on CPU; GPU untested), but only show
with ``.grad`` gradients (not ``main_grad``) and, for 5, a data-parallel degree above 1.

Collectives: V1's ``reduce`` and the ``broadcast``/``all_gather`` of parameters work on gloo as
they are (a gloo ``reduce`` leaves scratch values in the non-destination ranks' tensors, which
no sharding path reads afterwards); V2's ``reduce_scatter`` goes through :mod:`.collectives`,
whose emulation copies the input first, so V2's in-place call (output = a slice of the input)
is safe.  Not covered: ``group_sharded_parallel(offload=True)`` (moves master weights to the
CPU and back with ``.cuda()``, meaningless on CPU), ``release_gradients`` and
``enable_fuse_optimizer_states`` (not tested).
"""
from __future__ import annotations

import functools

from ..patching import PatchSignatureError

__all__ = ["apply", "CPU_ALIGNMENT_BYTES"]

# Byte alignment of every tensor inside a fused buffer on CPU.  Paddle's CPU allocator hands out
# 64-byte aligned blocks, so 64 keeps each parameter view as aligned as a tensor of its own
# without padding tiny parameters to a page.
CPU_ALIGNMENT_BYTES = 64


def _is_cpu_place(place) -> bool:
    from paddle.base import core

    return isinstance(place, core.CPUPlace)


# ---------------------------------------------------------------------------
# 1. tensor fusion helper: a "cpu" device type
# ---------------------------------------------------------------------------

def _make_device_type(orig, helper):
    @functools.wraps(orig)
    def get_current_device_type():
        # The stock function asks the place for get_device_type(), which CPUPlace lacks.
        if _is_cpu_place(helper._current_expected_place_()):
            return "cpu"
        return orig()

    return get_current_device_type


# ---------------------------------------------------------------------------
# 2. ParamStorage on CPU: nothing to move to a device
# ---------------------------------------------------------------------------

def _make_add_rank_params(orig):
    @functools.wraps(orig)
    def add_rank_params(self, trainable_params, param2align, convert_gpu=True):
        # The buffer of a "cpu" storage already lives where the parameters must end up.  The
        # converting path would read param.cpu() after clearing the parameter (on CPU the two
        # share memory) and then send the buffer to cvt_to_device, which raises on CPU.
        if self._device == "cpu":
            convert_gpu = False
        return orig(self, trainable_params, param2align, convert_gpu)

    return add_rank_params


# ---------------------------------------------------------------------------
# 3, 4, 5. DygraphShardingOptimizerV2: gradients stay views of the comm buffers; slices
# are ready before the data-parallel all-reduce
# ---------------------------------------------------------------------------

def _grad_view_intact(buffer, param) -> bool:
    """Whether ``param``'s gradient is still the slice of ``buffer.grad_storage`` it was given."""
    view = buffer._sharding_param_grad_view[param.name]
    grad = param.main_grad if buffer.use_main_grad else param._grad_ivar()
    if grad is None or not grad._is_initialized() or buffer.grad_storage is None:
        return False
    offset = view._index * buffer.grad_storage.element_size()
    return grad.data_ptr() == buffer.grad_storage.data_ptr() + offset


def _relink_grads(opt) -> int:
    """Copy any gradient that backward put in a fresh tensor back into its comm buffer slice and
    make it a view again; returns how many were relinked."""
    import paddle

    relinked = 0
    for buffer in opt._comm_buffer_list:
        if buffer.grad_storage is None:  # release_grads: Paddle copies into a new buffer itself
            continue
        for param in buffer.params:
            if _grad_view_intact(buffer, param):
                continue
            view = buffer._sharding_param_grad_view[param.name]
            grad = param.main_grad if buffer.use_main_grad else param._grad_ivar()
            target = buffer.grad_storage._slice(view._index, view._index + param._numel())
            if grad is not None and grad._is_initialized():
                paddle.assign(grad.reshape([-1]).astype(target.dtype), target)
            else:
                target.zero_()
            view._link_grad_to_buffer()
            relinked += 1
    return relinked


def _make_v2_clear_grad(orig):
    @functools.wraps(orig)
    def clear_grad(self, set_to_zero=True):
        # Tensor.clear_gradient(set_to_zero=True) zeroes the gradient but marks it "fake empty",
        # so the next backward assigns a new tensor instead of accumulating into the view of the
        # comm buffer: the buffer keeps zeros, and every step after the first reduce-scatters
        # zeros (silently wrong training).  Zero the buffers in place instead.
        if not set_to_zero or self.sd_release_grads or not self._comm_buffer_list:
            return orig(self, set_to_zero)
        import paddle

        kept = set()
        with paddle.no_grad():
            for buffer in self._comm_buffer_list:
                if buffer.grad_storage is None:
                    continue
                intact = [p for p in buffer.params if _grad_view_intact(buffer, p)]
                buffer.grad_storage.zero_()
                kept.update(id(p) for p in intact)
        # anything else (no view, main_grad) gets the stock treatment, run on just those
        rest = [p for p in self._parameter_list if id(p) not in kept]
        if rest:
            saved = self._parameter_list
            self._parameter_list = rest
            try:
                orig(self, set_to_zero)
            finally:
                self._parameter_list = saved

    return clear_grad


def _make_v2_reduce_gradients(orig):
    @functools.wraps(orig)
    def reduce_gradients(self, parameter_list, hcg):
        # A gradient cleared elsewhere (Layer.clear_gradients, Tensor.clear_gradient) comes back
        # from backward as a new tensor; put it into the buffer before the buffer is reduced.
        relinked = _relink_grads(self)
        self._ph_grads_relinked = getattr(self, "_ph_grads_relinked", 0) + relinked
        return orig(self, parameter_list, hcg)

    return reduce_gradients


def _make_v2_filter_parameters(orig):
    @functools.wraps(orig)
    def filter_parameters(self, parameter_list, hcg):
        # The slice parameters get their storage and gradient in step(), after this filter has
        # chosen what the data-parallel group all-reduces: on the first step every slice is
        # still uninitialised and is left out, so sharding x dp trains step 1 on the sharding
        # group's gradient only.  Give them storage and gradients first (step() repeats the same
        # assignment, which is idempotent).
        if not self.sd_release_grads and _slices_pending(self):
            self._assign_slice_grad()
        return orig(self, parameter_list, hcg)

    return filter_parameters


def _slices_pending(opt) -> bool:
    """A non-empty slice of some parameter whose slice parameter has no storage yet."""
    opt._collect_comm_buffers()
    for buffer in opt._comm_buffer_list:
        for name, view in buffer._sharding_param_grad_view.items():
            if view.has_effective_slice_param and not opt._slice_params[name]._is_initialized():
                return True
    return False


# ---------------------------------------------------------------------------
# 6. group sharded (stage 2 / 3): the device checks accept CPU
# ---------------------------------------------------------------------------

class _ModuleView:
    """Stands in for a module (``paddle``, ``paddle.device``, ``paddle.base.core``) inside one of
    Paddle's sharding modules: every attribute is the module's own, except the few device
    queries given as ``overrides``, which that sharding module uses only to refuse CPU."""

    def __init__(self, module, **overrides):
        self._module = module
        self._overrides = overrides

    def __getattr__(self, name):
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._module, name)

    def __repr__(self):
        return f"<paddle_hybrid CPU view of {self._module!r}: {sorted(self._overrides)}>"


def _custom_types_with_cpu(real):
    def get_all_custom_device_type():
        return [*real(), "cpu"]

    return get_all_custom_device_type


def _build_check_passes():
    """``is_compiled_with_cuda`` as the stage 2/3 constructors see it: they use it only in the
    check that refuses a CPU build, and run on CPU as they are once it passes."""
    return True


def _device_with_index(real):
    def get_device():
        device = real()
        return device if ":" in device else f"{device}:0"

    return get_device


# ---------------------------------------------------------------------------
# 7. GroupShardedClipGrad on CPU
# ---------------------------------------------------------------------------

def _clip_on_cpu(clip, params_grads):
    """Global-norm clipping of a group-sharded model whose tensors live on the CPU: what
    ``GroupShardedClipGrad`` computes, without moving the norm to a GPU first.

    Squared norms are summed per gradient in its own dtype and taken in float32.  Sliced
    parameters (stage 3 slices, stage 2 rank-local parameters) are summed over the group; a
    parameter marked ``unslice`` is whole on every rank and counted once.
    """
    import paddle
    import paddle.distributed as dist
    from paddle.base import core

    def total(parts):
        return paddle.add_n(parts) if parts else paddle.zeros([], dtype=paddle.float32)

    counted = (paddle.float16, paddle.bfloat16, paddle.float32)
    with paddle.no_grad():  # as the stock method
        sharded, whole = [], []
        for p, g in params_grads:
            if g is None or getattr(p, "need_clip", True) is False or p.dtype not in counted:
                continue
            if g.type == core.VarDesc.VarType.SELECTED_ROWS:
                g = clip._clip.get_tensor_from_selected_rows(clip._clip.merge_selected_rows(g))
            square_sum = paddle.sum(paddle.square(g)).astype(paddle.float32)
            (whole if hasattr(p, "unslice") else sharded).append(square_sum)

        global_sq = total(sharded)
        dist.all_reduce(global_sq, group=clip._group)
        global_norm = paddle.sqrt(global_sq + total(whole))
        max_norm = paddle.full([], clip.clip_norm, dtype=global_norm.dtype)
        factor = max_norm / paddle.maximum(global_norm, max_norm)
        for p, g in params_grads:
            if g is None or getattr(p, "need_clip", True) is False:
                continue
            keep = g.stop_gradient
            g.stop_gradient = True  # scale_ in place on a gradient that autograd could track
            g.scale_(factor.astype(paddle.float16) if p.dtype == paddle.float16 else factor)
            g.stop_gradient = keep
    return params_grads


def _make_clip(orig):
    @functools.wraps(orig)
    def _dygraph_clip(self, params_grads):
        # Stock code reads a device index from self._device ("cpu" has none: IndexError) and,
        # when paddle.get_device() is "cpu", moves the norm to a GPU (.cuda(): "No available
        # device found") before the all_reduce.  On CPU nothing has to move.
        if str(self._device).split(":")[0] != "cpu":
            return orig(self, params_grads)
        return _clip_on_cpu(self, params_grads)

    return _dygraph_clip


def apply(patcher) -> None:
    import paddle
    from paddle.base import core
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import dygraph_sharding_optimizer as dso
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_optimizer_stage2 as gso2
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as gs3
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_storage as storage
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_utils as gsu
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh
    from paddle.distributed.sharding import group_sharded as gs

    # --- check everything first ---------------------------------------------------------
    patcher.check_params(tfh.get_current_device_type, [], "tensor_fusion_helper.get_current_device_type")
    alignment = patcher.require(tfh, "alignment", "tensor_fusion_helper")
    patcher.require(tfh, "_current_expected_place_", "tensor_fusion_helper")
    patcher.require(tfh.ShardingGradView, "_link_grad_to_buffer", "ShardingGradView")
    patcher.check_params(storage.ParamStorage.add_rank_params,
                         ["self", "trainable_params", "param2align", "convert_gpu"], "ParamStorage.add_rank_params")
    v2 = dso.DygraphShardingOptimizerV2
    patcher.check_params(v2.clear_grad, ["self", "set_to_zero"], "DygraphShardingOptimizerV2.clear_grad")
    for name in ("reduce_gradients", "filter_parameters"):
        patcher.check_params(getattr(v2, name), ["self", "parameter_list", "hcg"], f"DygraphShardingOptimizerV2.{name}")
    for name in ("_assign_slice_grad", "_collect_comm_buffers"):
        patcher.require(v2, name, "DygraphShardingOptimizerV2")
    # the views replace module globals that must be the real modules
    for mod, name, real in ((gs, "paddle", paddle), (gso2, "paddle", paddle), (gso2, "core", core),
                            (gs3, "core", core)):
        if patcher.require(mod, name, mod.__name__) is not real:
            raise PatchSignatureError(f"{patcher.component}: {mod.__name__}.{name} is not the module the "
                                      f"sharding patch expects; set {patcher.off_switch} to run without it.")
    patcher.check_params(gsu.GroupShardedClipGrad._dygraph_clip, ["self", "params_grads"],
                         "GroupShardedClipGrad._dygraph_clip")

    # --- 1, 2: tensor fusion and parameter storage on CPU ----------------------------------
    patcher.set(tfh, "alignment", {**alignment, "cpu": CPU_ALIGNMENT_BYTES})
    patcher.set(tfh, "get_current_device_type", _make_device_type(tfh.get_current_device_type, tfh))
    patcher.set(storage.ParamStorage, "add_rank_params", _make_add_rank_params(storage.ParamStorage.add_rank_params))
    # --- 3, 4, 5: sharding V2 gradients ----------------------------------------------------
    patcher.set(v2, "clear_grad", _make_v2_clear_grad(v2.clear_grad))
    patcher.set(v2, "reduce_gradients", _make_v2_reduce_gradients(v2.reduce_gradients))
    patcher.set(v2, "filter_parameters", _make_v2_filter_parameters(v2.filter_parameters))
    # --- 6, 7: group sharded ---------------------------------------------------------------
    patcher.set(gs, "paddle", _ModuleView(paddle, device=_ModuleView(
        paddle.device, get_all_custom_device_type=_custom_types_with_cpu(paddle.device.get_all_custom_device_type))))
    patcher.set(gso2, "core", _ModuleView(core, is_compiled_with_cuda=_build_check_passes))
    patcher.set(gso2, "paddle", _ModuleView(paddle, get_device=_device_with_index(paddle.get_device)))
    patcher.set(gs3, "core", _ModuleView(core, is_compiled_with_cuda=_build_check_passes))
    patcher.set(gsu.GroupShardedClipGrad, "_dygraph_clip", _make_clip(gsu.GroupShardedClipGrad._dygraph_clip))
