"""Fleet sharding on CPU/gloo: stage 1 (``sharding_degree``, V1 and V2 with
``sharding_configs.split_param``, tensor fusion, comm overlap, with DP and PP), the group-sharded
classes (``group_sharded_parallel`` levels ``os``, ``os_g``, ``p_g_os``, and
``GroupShardedOptimizerStage2`` / ``GroupShardedStage2`` / ``GroupShardedStage3`` built directly),
with ``save_group_sharded_model``.

Device rule: every replacement decides per call.  It does its CPU work only when the call is
on the CPU (the place, the storage or the run is on the CPU; the group is gloo where one is
involved) and otherwise calls Paddle's original unchanged, so on a CUDA build nothing changes
for GPU runs even with ``cpu='on'``.

1. ``tensor_fusion_helper.get_current_device_type`` asks the place for ``get_device_type()``,
   which ``CPUPlace`` lacks, and its ``alignment`` table has no CPU entry (V2 always, V1 with
   ``tensor_fusion``/``comm_overlap``): "tensor fusion helper now only support
   dict_keys(['gpu', 'npu', 'xpu']), but got device unknown instead".  Patch: "cpu" for a
   CPUPlace, and ``alignment["cpu"] = 64`` bytes (the CPU allocator's own alignment).
2. ``ParamStorage.add_rank_params`` (V1 tensor fusion, group sharded stage 2) moves the fused
   buffer to the device: it clears each parameter and then reads ``param.cpu()``, which on CPU
   is the same memory ("(PreconditionNotMet) Tensor not initialized yet when
   DenseTensor::place() is called"), and ``cvt_to_device`` raises on a CPU build.  Patch: a
   "cpu" storage whose buffer is on the CPU takes Paddle's own no-conversion path
   (``convert_gpu=False``).
3. ``GroupShardedOptimizerStage2``, ``GroupShardedStage2`` and ``GroupShardedStage3`` take a
   ``device`` argument whose default is ``"gpu"`` (``"xpu"`` on an XPU build), whatever the run
   is on; ``group_sharded_parallel`` passes the real one, a user building the classes directly
   usually does not.  Built that way on CPU, stage 2 makes "gpu" parameter storages, and 2
   above fails with the same "Tensor not initialized" error.  Patch: when ``device`` is not
   given, the run is on the CPU and the group (or the global group) is gloo, the constructors
   get ``device="cpu"``.
4. ``group_sharded_parallel``: "group_sharded_parallel only support gpu, xpu and custom_device
   now"; the stage 2/3 constructors: "Only GPU and XPU and CustomDevice is supported now"; then
   ``GroupShardedOptimizerStage2`` reads a device index from ``paddle.get_device()`` ("cpu":
   "IndexError: list index out of range").  Patch: in those three modules only, the module-level
   ``paddle``/``core`` is a device answer (``Patcher.answer``) identical to the module except for the
   queries used there to refuse CPU; they answer "CPU accepted" (CPU among the custom device
   types, the build check passes, device index 0) only while the run is on the CPU, and
   Paddle's own answer otherwise.  The functions themselves are untouched, so a
   ``group_sharded_parallel`` imported before ``paddle_hybrid`` is fixed too.
5. ``GroupShardedClipGrad._dygraph_clip`` (``ClipGradByGlobalNorm`` with stage 3, or stage 2
   outside hybrid parallel) reads a device index ("IndexError") and moves the norm to a GPU
   ("ValueError: No available device found.").  Patch: for a clip on the CPU over a gloo group,
   the same global norm (sliced parameters summed over the group, ``unslice`` ones counted
   once) without the move.

Sharding V2's gradient defects (``clear_grad`` leaving "fake empty" gradients, slices missing
from the DP all-reduce on step 1) are not CPU-specific: :mod:`paddle_hybrid.dygraph.fleet_fixes.sharding_v2_grads`
fixes them on every device.

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
import inspect

from ...registry.device import custom_device_types_with_cpu, is_gloo, on_cpu, running_on_cpu
from ...registry.patching import PatchSignatureError

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
        if self._device == "cpu" and on_cpu(self.buffer):
            convert_gpu = False
        return orig(self, trainable_params, param2align, convert_gpu)

    return add_rank_params


# ---------------------------------------------------------------------------
# 3. group sharded classes built directly: their default device on CPU
# ---------------------------------------------------------------------------

def _make_default_device_init(orig):
    """``__init__`` of a group-sharded class whose ``device`` defaults to "gpu"/"xpu": a run on
    the CPU over gloo that does not name a device gets "cpu"."""
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if "device" not in bound.arguments and running_on_cpu() and is_gloo(bound.arguments.get("group")):
            kwargs["device"] = "cpu"
        return orig(self, *args, **kwargs)

    return __init__


# ---------------------------------------------------------------------------
# 4. group sharded (stage 2 / 3): the device checks accept CPU while the run is on the CPU
# ---------------------------------------------------------------------------

def _compiled_with_cuda():
    """What the stage 2/3 constructors' build check hears on a CPU run: they use it only to refuse
    a CPU build, and run on CPU as they are once it passes."""
    return True


def _cpu_with_index():
    return "cpu:0"


# ---------------------------------------------------------------------------
# 5. GroupShardedClipGrad on CPU
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
        if str(self._device).split(":")[0] != "cpu" or not is_gloo(self._group):
            return orig(self, params_grads)
        return _clip_on_cpu(self, params_grads)

    return _dygraph_clip


def apply(config, patcher) -> None:
    import paddle
    from paddle.base import core
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_optimizer_stage2 as gso2
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage2 as gs2
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as gs3
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_storage as storage
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_utils as gsu
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh
    from paddle.distributed.sharding import group_sharded as gs

    # --- check everything first ---------------------------------------------------------
    patcher.check_params(tfh.get_current_device_type, [], "tensor_fusion_helper.get_current_device_type")
    alignment = patcher.require(tfh, "alignment", "tensor_fusion_helper")
    patcher.require(tfh, "_current_expected_place_", "tensor_fusion_helper")
    patcher.check_params(storage.ParamStorage.add_rank_params,
                         ["self", "trainable_params", "param2align", "convert_gpu"], "ParamStorage.add_rank_params")
    constructors = [patcher.require(mod, name, mod.__name__) for mod, name in (
        (gso2, "GroupShardedOptimizerStage2"), (gs2, "GroupShardedStage2"), (gs3, "GroupShardedStage3"))]
    for cls in constructors:
        params = inspect.signature(cls.__init__).parameters
        if "device" not in params or "group" not in params:
            raise PatchSignatureError(f"{patcher.component}: {cls.__name__}.__init__ has no 'device' or 'group' "
                                      f"parameter ({list(params)}); unexpected Paddle. Set {patcher.off_switch} "
                                      "to run without these patches.")
    # the device answers replace module globals that must be the real modules
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
    # --- 3: the group-sharded classes' default device ---------------------------------------
    for cls in constructors:
        patcher.set(cls, "__init__", _make_default_device_init(cls.__init__))
    # --- 4, 5: group sharded device checks and clipping -----------------------------------
    why = "group sharded device checks on a CPU run"
    patcher.answer(gs, "paddle", {"device.get_all_custom_device_type":
                                  custom_device_types_with_cpu},
                   when=running_on_cpu, why=why)
    patcher.answer(gso2, "core", {"is_compiled_with_cuda": _compiled_with_cuda}, when=running_on_cpu, why=why)
    patcher.answer(gso2, "paddle", {"get_device": _cpu_with_index}, when=running_on_cpu, why=why)
    patcher.answer(gs3, "core", {"is_compiled_with_cuda": _compiled_with_cuda}, when=running_on_cpu, why=why)
    patcher.set(gsu.GroupShardedClipGrad, "_dygraph_clip", _make_clip(gsu.GroupShardedClipGrad._dygraph_clip))
