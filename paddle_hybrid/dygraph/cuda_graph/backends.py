"""Two ways to "capture and replay" a piece of work, behind one interface.

A backend turns ``body`` (a function with no arguments that reads fixed input
buffers and returns a flat list of tensors or ``None``) into a
:class:`CapturedGraph` whose ``outputs`` are fixed tensors: every
:meth:`CapturedGraph.replay` recomputes ``body`` from the current contents of
the input buffers and leaves the result in the *same* output tensors.

* :class:`CudaGraphBackend` records ``body`` with
  ``paddle.device.cuda.graphs.CUDAGraph`` into a memory pool shared by all
  graphs of one model (``pool_id`` from ``core.CUDAGraph.gen_new_memory_pool_id``).
* :class:`EagerEmulationBackend` runs ``body`` eagerly on every replay and
  copies its result into the fixed output tensors made at capture.  It keeps
  the buffer discipline of a real graph: what a replay reads are the input
  buffers, what it writes are the output buffers, and the state a later graph
  needs (the autograd graph of the last forward) is replaced by the next
  replay, just as a CUDA graph's private memory is overwritten.  So a buffer
  reused too early gives wrong numbers on CPU as it would on a GPU.

After :meth:`GraphBackend.capture` returns, ``outputs`` already hold the
result of one run of ``body`` (the CUDA backend replays once after capture).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import paddle

__all__ = [
    "GraphBackend",
    "CapturedGraph",
    "CudaGraphBackend",
    "EagerEmulationBackend",
    "resolve_backend",
    "cuda_graphs_available",
    "auto_backend_name",
]


def cuda_graphs_available() -> bool:
    """True when this Paddle build can capture CUDA graphs."""
    from ...registry.device import cuda_build

    if not cuda_build():
        return False
    try:
        from paddle.device.cuda.graphs import is_cuda_graph_supported
    except ImportError:  # pragma: no cover - older Paddle
        return False
    return bool(is_cuda_graph_supported())


_warned_unrun = False


def auto_backend_name(config=None) -> str:
    """What ``backend="auto"`` picks, by where the run is, not by how Paddle was compiled.

    ``"cuda"`` only when the run is on a GPU that Paddle can capture on *and* the device rule
    lets the never-executed CUDA backend run (``cuda_graph=True`` or ``allow_unrun`` in ``config``,
    by default the config the plugin was installed with; not installed: no opt-in);
    a GPU run without that opt-in gets the emulation, with one warning saying how to opt in.
    Otherwise (a CPU run, also on a CUDA build) the emulation.
    """
    global _warned_unrun
    from ...registry.device import running_on_cpu
    from ...registry.gate import decide, opt_in_hint

    if running_on_cpu() or not cuda_graphs_available():
        return "emulation"
    if config is None:  # the config the cuda_graph component was installed with, if it was
        from . import COMPONENT

        config = COMPONENT.config
    if config is not None and decide(config, "cuda_graph").on:
        return "cuda"
    if not _warned_unrun:
        _warned_unrun = True
        import warnings

        warnings.warn("paddle_hybrid: CUDAGraphedLayer(backend='auto') uses the eager emulation on this GPU run: "
                      "the CUDA-graph backend is written but has never run on a GPU; "
                      + opt_in_hint("cuda_graph") + ".", RuntimeWarning, stacklevel=4)
    return "emulation"


class CapturedGraph:
    """A captured body: fixed ``outputs`` and :meth:`replay`."""

    outputs: List[Optional[paddle.Tensor]]

    def replay(self) -> None:
        raise NotImplementedError

    def autograd_outputs(self) -> List[Optional[paddle.Tensor]]:
        """Tensors a later backward graph differentiates: on CUDA the captured
        outputs themselves; in the emulation the result of the last replay."""
        raise NotImplementedError

    def reset(self) -> None:
        """Free what the graph holds."""


class GraphBackend:
    """Interface of a capture/replay backend."""

    name = "abstract"

    def new_pool(self):
        """A handle of a memory pool that several graphs can share."""
        raise NotImplementedError

    def capture(self, body: Callable[[], list], pool) -> CapturedGraph:
        raise NotImplementedError


def _detached_copy(t):
    if t is None:
        return None
    out = t.detach().clone()
    out.stop_gradient = True
    return out


class _EmulatedGraph(CapturedGraph):
    def __init__(self, body, result):
        self._body = body
        self._last = result
        self.outputs = [_detached_copy(t) for t in result]

    def replay(self) -> None:
        result = self._body()
        if len(result) != len(self.outputs):
            raise RuntimeError(
                "EagerEmulationBackend: a replay returned "
                f"{len(result)} tensors, the capture {len(self.outputs)}; the captured "
                "body must not change its structure between replays."
            )
        with paddle.no_grad():
            for fixed, new in zip(self.outputs, result):
                if (fixed is None) != (new is None):
                    raise RuntimeError(
                        "EagerEmulationBackend: an output that was None at capture is "
                        "not None at replay (or the reverse)."
                    )
                if fixed is not None:
                    paddle.assign(new.detach(), output=fixed)
        self._last = result

    def autograd_outputs(self):
        return self._last

    def reset(self) -> None:
        self._last = None
        self.outputs = []


class EagerEmulationBackend(GraphBackend):
    """Runs the body eagerly; used where CUDA graphs are unavailable (CPU)."""

    name = "emulation"

    def new_pool(self):
        return None

    def capture(self, body, pool) -> CapturedGraph:
        return _EmulatedGraph(body, body())


class _CudaGraph(CapturedGraph):
    def __init__(self, graph, outputs):
        self._graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        self._graph.replay()

    def autograd_outputs(self):
        return self.outputs

    def reset(self) -> None:
        self._graph.reset()
        self.outputs = []


class CudaGraphBackend(GraphBackend):
    """Captures with ``paddle.device.cuda.graphs.CUDAGraph``.

    ``mode`` is the capture mode of ``CUDAGraph`` ("thread_local", "global" or
    "relaxed").  Every graph captured with the same pool handle allocates from
    one memory pool; the caller captures graphs in the order it replays them
    (see :class:`paddle_hybrid.dygraph.cuda_graph.GraphPool`).
    """

    name = "cuda"

    def __init__(self, mode: str = "thread_local"):
        if not cuda_graphs_available():
            raise RuntimeError(
                "CudaGraphBackend: this Paddle build cannot capture CUDA graphs "
                "(it is not compiled with CUDA, or cannot capture); "
                "use backend='emulation' or backend='auto'."
            )
        if mode not in ("thread_local", "global", "relaxed"):
            raise ValueError(f"CudaGraphBackend: mode must be 'thread_local', 'global' or 'relaxed', got {mode!r}.")
        self.mode = mode

    def new_pool(self):
        from paddle.base import core

        return core.CUDAGraph.gen_new_memory_pool_id()

    def capture(self, body, pool) -> CapturedGraph:
        from paddle.device.cuda.graphs import CUDAGraph

        graph = CUDAGraph(mode=self.mode, pool_id=pool)
        graph.capture_begin()
        try:
            outputs = body()
        finally:
            graph.capture_end()
        captured = _CudaGraph(graph, list(outputs))
        # Capture records kernels without running them; one replay computes
        # the outputs of this call.
        captured.replay()
        return captured


def resolve_backend(backend) -> GraphBackend:
    """``"auto"`` (see :func:`auto_backend_name`), ``"cuda"``, ``"emulation"`` or a
    :class:`GraphBackend` instance."""
    if isinstance(backend, GraphBackend):
        return backend
    if backend == "auto":
        return CudaGraphBackend() if auto_backend_name() == "cuda" else EagerEmulationBackend()
    if backend == "cuda":
        return CudaGraphBackend()
    if backend == "emulation":
        return EagerEmulationBackend()
    raise ValueError(
        f"backend must be 'auto', 'cuda', 'emulation' or a GraphBackend instance, got {backend!r}."
    )
