"""The errors of graphed layers: one base class, one subclass per kind of misuse."""

__all__ = ["CudaGraphError", "StaticBufferReuseError", "GraphOrderError", "SignatureChangeError"]


class CudaGraphError(RuntimeError):
    """Misuse of a graphed layer."""


class StaticBufferReuseError(CudaGraphError):
    """A graph's static buffers would be (or were) refilled before the backward
    of the microbatch that owns them."""


class GraphOrderError(CudaGraphError):
    """Graphs sharing a memory pool replayed out of their capture order."""


class SignatureChangeError(CudaGraphError):
    """Inputs changed shape/dtype/structure and re-capture is disabled."""
