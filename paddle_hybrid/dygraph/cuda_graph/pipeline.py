"""``PipelineLayer(..., use_cudagraph=True)`` with :class:`CUDAGraphedLayer` (component
``cuda_graph``).

Paddle 3.3.1's ``PipelineLayer._build_layer_impl`` wraps each run of
consecutive layers of a stage (or of a virtual-pipeline chunk) in
``PipelineSublayers`` and then in ``CUDAGraphedLayer``, a name it imported
from ``paddle.device.cuda.cuda_graphed_layer``; shared layers
(``SharedLayerDesc``) and plain callables stay eager.  This component changes two things in
``pp_layers`` and ``paddle_hybrid.uninstall()`` undoes them:

* the module's ``CUDAGraphedLayer`` name becomes a factory building the
  plugin's :class:`CUDAGraphedLayer`;
* ``PipelineLayer._build_layer_impl`` is wrapped so every graphed layer of one
  ``PipelineLayer`` shares that model's :class:`GraphPool`
  (``pipeline_layer.cuda_graph_pool``), i.e. one memory pool, captured in run order.

Run on CPU only, with the eager emulation backend, on Paddle 3.2.x and 3.3.x: the CUDA backend
was written against Paddle's documented API and never executed.  ``cuda_graph`` is a
tri-state field of :mod:`paddle_hybrid.registry.gate`: on a build with an accelerator the graphs
stay off until ``cuda_graph=True`` or ``allow_unrun=True``.  The allocator flag CUDA
graphs want is its own component, :mod:`paddle_hybrid.dygraph.cuda_malloc_async`.
"""
from __future__ import annotations

import functools
import threading

__all__ = ["apply", "is_active", "graphed_layers"]

_local = threading.local()


def is_active() -> bool:
    from . import COMPONENT

    return COMPONENT.is_active()


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


def apply(config, patcher) -> None:
    pp = _pp_layers()
    build = patcher.require(pp.PipelineLayer, "_build_layer_impl", "PipelineLayer")
    patcher.require(pp, "CUDAGraphedLayer", "pp_layers")
    patcher.set(pp, "CUDAGraphedLayer", _factory(config))
    patcher.set(pp.PipelineLayer, "_build_layer_impl", _wrap_build(build))


def graphed_layers(pipeline_layer) -> list:
    """The plugin's :class:`CUDAGraphedLayer` objects of a ``PipelineLayer``
    (every stage chunk), in run order."""
    from .graphed_layer import CUDAGraphedLayer

    chunks = getattr(pipeline_layer, "_model_chunks", None)
    funcs = [f for c in chunks for f in c.get_run_function()] if chunks else list(pipeline_layer.run_function)
    return [f for f in funcs if isinstance(f, CUDAGraphedLayer)]
