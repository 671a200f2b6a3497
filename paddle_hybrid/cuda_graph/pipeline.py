"""``PipelineLayer(..., use_cudagraph=True)`` with :class:`CUDAGraphedLayer`.

Paddle 3.3.1's ``PipelineLayer._build_layer_impl`` wraps each run of
consecutive layers of a stage (or of a virtual-pipeline chunk) in
``PipelineSublayers`` and then in ``CUDAGraphedLayer``, a name it imported
from ``paddle.device.cuda.cuda_graphed_layer``; shared layers
(``SharedLayerDesc``) and plain callables stay eager.  This component, one of
``paddle_hybrid._install.COMPONENTS``, changes two things in ``pp_layers`` and
undoes them in :func:`uninstall`:

* the module's ``CUDAGraphedLayer`` name becomes a factory building the
  plugin's :class:`CUDAGraphedLayer`;
* ``PipelineLayer._build_layer_impl`` is wrapped so every graphed layer of one
  ``PipelineLayer`` shares that model's :class:`GraphPool`
  (``pipeline_layer.cuda_graph_pool``), i.e. one memory pool, captured in run order.

It also applies ``PluginConfig.cuda_malloc_async``: Paddle reads
``FLAGS_use_cuda_malloc_async_allocator`` once, when the GPU allocator is
built, so the flag is set at ``import paddle_hybrid`` (before any GPU tensor
exists, if the plugin is imported first) and restored by :func:`uninstall`.

Written for Paddle 3.3.x; on another version install raises, naming it.
"""
from __future__ import annotations

import functools
import threading
import warnings

__all__ = ["install", "uninstall", "is_active", "SUPPORTED_PADDLE", "graphed_layers"]

SUPPORTED_PADDLE = ("3.3.",)

_state: dict = {}
_local = threading.local()


def is_active() -> bool:
    return bool(_state)


def _pp_layers():
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

    return pp_layers


def _factory(config):
    from .graphed_layer import CUDAGraphedLayer, GraphPool

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
        from .graphed_layer import GraphPool

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


def _set_malloc_async(config):
    import paddle

    flag = "FLAGS_use_cuda_malloc_async_allocator"
    if not config.cuda_malloc_async:
        return
    try:
        before = paddle.get_flags([flag])[flag]
    except Exception as exc:  # flag unknown to this build
        raise RuntimeError(
            f"paddle_hybrid: PluginConfig.cuda_malloc_async is set but this Paddle has no {flag} ({exc})."
        ) from None
    if paddle.is_compiled_with_cuda():
        try:
            allocated = paddle.device.cuda.memory_allocated() > 0
        except Exception:
            allocated = False
        if allocated:
            warnings.warn(
                f"paddle_hybrid: {flag} set after GPU memory was already allocated; Paddle reads it "
                "once when it builds the GPU allocator, so it may have no effect. Import paddle_hybrid "
                "before creating any GPU tensor.",
                stacklevel=3,
            )
    paddle.set_flags({flag: True})
    _state["malloc_async_before"] = before


def install(config) -> None:
    if _state:
        return
    import paddle

    if config.pipeline_cudagraph:
        if not paddle.__version__.startswith(SUPPORTED_PADDLE):
            raise RuntimeError(
                f"paddle_hybrid.cuda_graph.pipeline: written for Paddle "
                f"{'/'.join(v + 'x' for v in SUPPORTED_PADDLE)}, found {paddle.__version__}; set "
                "PADDLE_HYBRID_PIPELINE_CUDAGRAPH=0 (PluginConfig.pipeline_cudagraph=False) to skip it."
            )
        pp = _pp_layers()
        _state["cls_name"] = pp.CUDAGraphedLayer
        _state["build"] = pp.PipelineLayer.__dict__["_build_layer_impl"]
        pp.CUDAGraphedLayer = _factory(config)
        pp.PipelineLayer._build_layer_impl = _wrap_build(_state["build"])
    _set_malloc_async(config)
    _state["installed"] = True


def uninstall() -> None:
    if not _state:
        return
    if "cls_name" in _state:
        pp = _pp_layers()
        pp.CUDAGraphedLayer = _state["cls_name"]
        pp.PipelineLayer._build_layer_impl = _state["build"]
    if "malloc_async_before" in _state:
        import paddle

        paddle.set_flags({"FLAGS_use_cuda_malloc_async_allocator": _state["malloc_async_before"]})
    _state.clear()


def graphed_layers(pipeline_layer) -> list:
    """The plugin's :class:`CUDAGraphedLayer` objects of a ``PipelineLayer``
    (every stage chunk), in run order."""
    from .graphed_layer import CUDAGraphedLayer

    chunks = getattr(pipeline_layer, "_model_chunks", None)
    funcs = [f for c in chunks for f in c.get_run_function()] if chunks else list(pipeline_layer.run_function)
    return [f for f in funcs if isinstance(f, CUDAGraphedLayer)]
