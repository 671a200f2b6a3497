"""The bookkeeping of one graphed layer: input signatures, graph pairs (one
per microbatch position, with a small state machine) and the microbatches in
flight.  No capture or replay happens here; :mod:`.graphed_layer` drives these
objects.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import paddle

from .pytree import TreeSpec

__all__ = ["Signature", "GraphPair", "Microbatch"]


class Signature:
    """What a set of graphs is captured for: the nesting of the inputs, the
    shape, dtype and stop_gradient of every input tensor, and the trainable
    parameters (by identity).  Calls with equal ``key`` share graphs."""

    __slots__ = ("spec", "metas", "params", "key")

    def __init__(self, spec: TreeSpec, leaves: Sequence[paddle.Tensor], params: List[paddle.Tensor]):
        self.spec = spec
        self.metas = tuple((tuple(t.shape), str(t.dtype), bool(t.stop_gradient)) for t in leaves)
        self.params = params
        self.key = (spec.structure, self.metas, tuple(id(p) for p in params))

    @property
    def input_needs_grad(self) -> List[bool]:
        return [not stop_gradient for _, _, stop_gradient in self.metas]

    def describe(self) -> str:
        shapes = ", ".join(f"{list(s)}:{d}{'' if sg else ':grad'}" for s, d, sg in self.metas)
        return f"[{shapes}] with {len(self.params)} trainable parameters"


class GraphPair:
    """The graphs of one microbatch position of one signature: fixed input
    buffers, forward graph, fixed output-gradient buffers, backward graph.

    States: *idle* --:meth:`start`--> *in flight* --:meth:`release`--> *idle*.
    A pair in flight holds a microbatch whose backward has not run, so its
    buffers must not be refilled.  ``generation`` counts the starts; a backward
    compares it with the one its microbatch got (:meth:`holds`), which catches
    a refill that slipped past the forward-side check.
    """

    IDLE = "idle"
    IN_FLIGHT = "in_flight"

    def __init__(self, index: int, static_inputs: List[paddle.Tensor]):
        self.index = index
        self.static_inputs = static_inputs
        self.fwd = None
        self.fwd_position = -1
        self.out_diff: List[int] = []  # positions of the differentiable outputs
        self.static_dys: Optional[List[paddle.Tensor]] = None
        self.bwd = None
        self.bwd_position = -1
        self.state = self.IDLE
        self.generation = 0

    @classmethod
    def for_inputs(cls, index: int, leaves: Sequence[paddle.Tensor]) -> "GraphPair":
        """A pair whose input buffers have the shape, dtype and stop_gradient of ``leaves``."""
        with paddle.no_grad():
            statics = []
            for t in leaves:
                s = paddle.empty(t.shape, dtype=t.dtype)
                s.stop_gradient = t.stop_gradient
                statics.append(s)
        return cls(index, statics)

    @property
    def in_flight(self) -> bool:
        return self.state == self.IN_FLIGHT

    def fill_inputs(self, leaves: Sequence[paddle.Tensor]) -> None:
        with paddle.no_grad():
            for s, t in zip(self.static_inputs, leaves):
                paddle.assign(t.detach(), output=s)

    def fill_output_grads(self, dys: Sequence[Optional[paddle.Tensor]]) -> None:
        """Copy the gradients of the differentiable outputs into their buffers.

        ``dys`` has one entry per output, differentiable or not (autograd
        passes zeros for the non-differentiable ones), so output ``i``'s
        gradient is ``dys[i]``; a missing or None gradient is zero."""
        outputs = self.fwd.outputs
        with paddle.no_grad():
            if self.static_dys is None:
                self.static_dys = [paddle.zeros(outputs[i].shape, dtype=outputs[i].dtype) for i in self.out_diff]
            for s, i in zip(self.static_dys, self.out_diff):
                dy = dys[i] if i < len(dys) else None
                if dy is None:
                    s.zero_()
                else:
                    paddle.assign(dy.detach(), output=s)

    def start(self) -> int:
        """The buffers now hold a new microbatch; its generation."""
        self.state = self.IN_FLIGHT
        self.generation += 1
        return self.generation

    def holds(self, generation: int) -> bool:
        """Whether the buffers still hold the microbatch that got ``generation``."""
        return self.in_flight and self.generation == generation

    def release(self) -> None:
        self.state = self.IDLE

    def reset(self) -> None:
        """Free the graphs and buffers (state and generation stay, so a
        microbatch still in flight finds out at its backward)."""
        for graph in (self.fwd, self.bwd):
            if graph is not None:
                graph.reset()
        self.fwd = self.bwd = None
        self.static_dys = None
        self.static_inputs = []


class Microbatch:
    """One forward whose backward has not run: its signature, its pair and
    the pair's generation when it was filled."""

    __slots__ = ("seq", "sig", "pair", "generation", "done")

    def __init__(self, seq: int, sig: Signature, pair: GraphPair, generation: int):
        self.seq = seq
        self.sig = sig
        self.pair = pair
        self.generation = generation
        self.done = False
