"""CUDA graphs for pipeline stages: :class:`CUDAGraphedLayer`, its shared
:class:`GraphPool`, two backends (CUDA, eager emulation) and the
``PipelineLayer(use_cudagraph=True)`` integration (:mod:`.pipeline`)."""
from .backends import (
    CudaGraphBackend,
    EagerEmulationBackend,
    GraphBackend,
    cuda_graphs_available,
    resolve_backend,
)
from .graphed_layer import (
    CUDAGraphedLayer,
    CudaGraphError,
    GraphOrderError,
    GraphPool,
    SignatureChangeError,
    StaticBufferReuseError,
)

__all__ = [
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
