"""``PipelineLayer(..., use_cudagraph=True)`` with :class:`CUDAGraphedLayer`.

Paddle 3.3.1's ``PipelineLayer._build_layer_impl`` wraps each run of
consecutive layers of a stage (or of a virtual-pipeline chunk) in
``PipelineSublayers`` and then in ``CUDAGraphedLayer``, a name it imported
from ``paddle.device.cuda.cuda_graphed_layer``; shared layers
(``SharedLayerDesc``) and plain callables stay eager.  This component, one of
``paddle_hybrid._install.COMPONENTS``, changes two things in ``pp_layers`` and
``paddle_hybrid.uninstall()`` undoes them:

* the module's ``CUDAGraphedLayer`` name becomes a factory building the
  plugin's :class:`CUDAGraphedLayer`;
* ``PipelineLayer._build_layer_impl`` is wrapped so every graphed layer of one
  ``PipelineLayer`` shares that model's :class:`GraphPool`
  (``pipeline_layer.cuda_graph_pool``), i.e. one memory pool, captured in run order.

It also applies ``PluginConfig.cuda_malloc_async``: Paddle reads
``FLAGS_use_cuda_malloc_async_allocator`` once, when the GPU allocator is
built, so the flag is set at ``import paddle_hybrid`` (before any GPU tensor
exists, if the plugin is imported first) and restored at uninstall.

Run on CPU only, with the eager emulation backend, on Paddle 3.2.x and 3.3.x: the CUDA backend
and the malloc flag were written against Paddle's documented API and never executed.  On a build
with an accelerator the device rule (:mod:`paddle_hybrid.device_rule`) keeps the graphs off until
``pipeline_cudagraph=True`` or ``allow_unrun=True``; ``cuda_malloc_async`` is off unless set.
"""
from __future__ import annotations

import functools
import threading
import warnings

__all__ = ["skip_reason", "apply", "is_active", "VERIFIED_PADDLE", "SWITCH", "graphed_layers"]

VERIFIED_PADDLE = ("3.2.", "3.3.")
SWITCH = ("PADDLE_HYBRID_PIPELINE_CUDAGRAPH=0 and PADDLE_HYBRID_CUDA_MALLOC_ASYNC=0 "
          "(PluginConfig(pipeline_cudagraph=False, cuda_malloc_async=False))")

_local = threading.local()


def is_active() -> bool:
    from .._install import component_state

    state = component_state(__name__)
    return state is not None and state.status == "active"


def _pp_layers():
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

    return pp_layers


def _factory(config):
    from .graphed_layer import CUDAGraphedLayer
    from .pool import GraphPool

    def make_graphed_layer(layer):
        pool = getattr(_local, "pool", None)
        if pool is None:  # built outside PipelineLayer: its own pool
            pool = GraphPool()
        return CUDAGraphedLayer(layer, num_warmup_steps=config.cuda_graph_warmup_steps, pool=pool)

    make_graphed_layer.__paddle_hybrid__ = True
    return make_graphed_layer


def _wrap_build(original):
    @functools.wraps(original)
    def _build_layer_impl(self, start, end):
        if not getattr(self, "use_cudagraph", False):
            return original(self, start, end)
        from .pool import GraphPool

        pool = self.__dict__.get("cuda_graph_pool")
        if pool is None:
            pool = GraphPool()
            object.__setattr__(self, "cuda_graph_pool", pool)
        previous = getattr(_local, "pool", None)
        _local.pool = pool
        try:
            return original(self, start, end)
        finally:
            _local.pool = previous

    _build_layer_impl.__paddle_hybrid__ = True
    return _build_layer_impl


def _flag_value(flag: str):
    import paddle

    try:
        return paddle.get_flags([flag])[flag]
    except ValueError as exc:  # what paddle.get_flags raises for a flag this build does not have
        raise RuntimeError(
            f"paddle_hybrid: PluginConfig.cuda_malloc_async is set but this Paddle has no {flag} ({exc})."
        ) from exc


def _gpu_memory_allocated(flag: str) -> bool:
    """Whether the GPU allocator already handed out memory, so setting ``flag`` comes too late.

    No GPU (a CPU build, or no device visible) means no allocator yet: False
    without asking.  If asking fails, that is reported as a warning naming the
    call (the flag is still set: it is only the check that could not run)."""
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return False
    try:
        return paddle.device.cuda.memory_allocated() > 0
    except Exception as exc:  # reported, not swallowed: the flag works, the check did not
        warnings.warn(
            f"paddle_hybrid: could not tell whether GPU memory was already allocated before setting "
            f"{flag}: paddle.device.cuda.memory_allocated() raised {exc!r}. If GPU tensors exist "
            "already, the flag has no effect.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False


def _set_malloc_async(config, patcher):
    import paddle

    flag = "FLAGS_use_cuda_malloc_async_allocator"
    if not config.cuda_malloc_async:
        return
    before = _flag_value(flag)
    if _gpu_memory_allocated(flag):
        warnings.warn(
            f"paddle_hybrid: {flag} set after GPU memory was already allocated; Paddle reads it "
            "once when it builds the GPU allocator, so it may have no effect. Import paddle_hybrid "
            "before creating any GPU tensor.",
            stacklevel=3,
        )
    paddle.set_flags({flag: True})
    patcher.on_revert(lambda: paddle.set_flags({flag: before}), flag)


def skip_reason(config):
    from ..device_rule import decide

    graphs = decide(config, "pipeline_cudagraph")
    if not graphs.on and not config.cuda_malloc_async:
        return graphs.reason + "; cuda_malloc_async=False"
    return None


def apply(config, patcher) -> None:
    from ..device_rule import decide

    if decide(config, "pipeline_cudagraph").on:
        pp = _pp_layers()
        build = patcher.require(pp.PipelineLayer, "_build_layer_impl", "PipelineLayer")
        patcher.require(pp, "CUDAGraphedLayer", "pp_layers")
        patcher.set(pp, "CUDAGraphedLayer", _factory(config))
        patcher.set(pp.PipelineLayer, "_build_layer_impl", _wrap_build(build))
    _set_malloc_async(config, patcher)


def graphed_layers(pipeline_layer) -> list:
    """The plugin's :class:`CUDAGraphedLayer` objects of a ``PipelineLayer``
    (every stage chunk), in run order."""
    from .graphed_layer import CUDAGraphedLayer

    chunks = getattr(pipeline_layer, "_model_chunks", None)
    funcs = [f for c in chunks for f in c.get_run_function()] if chunks else list(pipeline_layer.run_function)
    return [f for f in funcs if isinstance(f, CUDAGraphedLayer)]
