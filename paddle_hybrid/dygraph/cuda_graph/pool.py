"""GraphPool: what all graphed layers of one model share.

One backend and one memory pool for every graph of the model, a position for
each graph in the order it was captured, and the count of microbatches in
flight, which splits the run into *cycles* (see :mod:`.graphed_layer`).

Why the order matters: graphs that share a memory pool may hand memory to
each other.  A graph that freed memory during its capture may see a graph
captured after it allocate the same memory.  Replaying in capture order keeps
every graph's view of the pool the one it had at capture, so within a cycle a
graph may replay only after every graph captured before it that already ran.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, List, Tuple

from .backends import GraphBackend, resolve_backend
from .errors import GraphOrderError

__all__ = ["GraphPool"]


class GraphPool:
    """What all graphed layers of one model share: the backend, its memory
    pool, the capture order and the count of microbatches in flight.

    Args:
        backend: "auto" (CUDA graphs where Paddle can capture them, else the
            eager emulation), "cuda", "emulation" or a
            :class:`~paddle_hybrid.dygraph.cuda_graph.backends.GraphBackend`.
    """

    def __init__(self, backend="auto"):
        self.backend: GraphBackend = resolve_backend(backend)
        self.layers: List[Any] = []  # the CUDAGraphedLayers using this pool
        self.cycle = 0
        self.in_flight = 0
        self._handle = None
        self._handle_made = False
        self._next_position = itertools.count()
        self._last_position = -1  # capture position of the graph that ran last in this cycle

    @property
    def handle(self):
        """The backend's memory pool, made on first use (after the device is chosen)."""
        if not self._handle_made:
            self._handle = self.backend.new_pool()
            self._handle_made = True
        return self._handle

    # -- capture and replay order -----------------------------------------
    def capture(self, body: Callable[[], list]) -> Tuple[Any, int]:
        """Capture ``body`` into the pool; the graph and its capture position."""
        graph = self.backend.capture(body, self.handle)
        position = next(self._next_position)
        self._last_position = position
        return graph, position

    def before_replay(self, position: int, what: str) -> None:
        """Called before the graph captured at ``position`` replays (before any
        of its buffers is filled): checks the order and records the replay."""
        self.check_replay_order(position, what)
        self._last_position = position

    def check_replay_order(self, position: int, what: str) -> None:
        """Raise :class:`GraphOrderError` if a graph captured after ``position``
        already ran in this cycle."""
        if position > self._last_position:
            return
        raise GraphOrderError(
            f"{what} would replay out of capture order in this cycle (captured at "
            f"position {position}, a graph captured at {self._last_position} already ran). "
            "Graphs that share one memory pool must replay in the order they were captured, "
            "so the schedule must be the same every step. If it changed on purpose (other "
            "number of microbatches or pipeline schedule), call reset() on the pool of the "
            "model between steps to capture again."
        )

    # -- microbatches in flight ---------------------------------------------
    def microbatch_started(self) -> None:
        self.in_flight += 1

    def microbatch_finished(self) -> None:
        """A backward ran; when none is left in flight the cycle ends and the
        replay order starts again from the first graph."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._end_cycle()

    def _end_cycle(self) -> None:
        self.cycle += 1
        self._last_position = -1

    def reset(self) -> None:
        """Drop every graph of every layer and forget the capture order.

        Microbatches still in flight are abandoned (their backward would
        raise).  The next cycle captures again."""
        for layer in self.layers:
            layer._drop_graphs()
        self._next_position = itertools.count()
        self.in_flight = 0
        self._end_cycle()
        self._handle = None
        self._handle_made = False
