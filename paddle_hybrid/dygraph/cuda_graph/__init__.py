"""CUDA graphs for pipeline stages.

* :mod:`.graphed_layer`: :class:`CUDAGraphedLayer`, the capture phases;
* :mod:`.pool`: :class:`GraphPool`, what the graphed layers of one model share;
* :mod:`.state`: signatures, graph pairs, microbatches in flight;
* :mod:`.pytree`: nested inputs and outputs as flat tensor lists and back;
* :mod:`.rng`: the random state warmup must leave alone;
* :mod:`.backends`: capture and replay (CUDA, eager emulation);
* :mod:`.errors`: the errors of misuse;
* :mod:`.pipeline`: the ``PipelineLayer(use_cudagraph=True)`` integration.
"""
from .backends import (
    CudaGraphBackend,
    EagerEmulationBackend,
    GraphBackend,
    cuda_graphs_available,
    resolve_backend,
)
from .errors import CudaGraphError, GraphOrderError, SignatureChangeError, StaticBufferReuseError
from .graphed_layer import CUDAGraphedLayer
from .pool import GraphPool
from ...registry.component import Component
from . import pipeline

COMPONENT = Component("cuda_graph", ("3.2.", "3.3."), "cuda_graph", pipeline.apply)

__all__ = [
    "COMPONENT",
    "CUDAGraphedLayer",
    "GraphPool",
    "CudaGraphError",
    "StaticBufferReuseError",
    "GraphOrderError",
    "SignatureChangeError",
    "GraphBackend",
    "CudaGraphBackend",
    "EagerEmulationBackend",
    "resolve_backend",
    "cuda_graphs_available",
]
