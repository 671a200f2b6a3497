"""CUDAGraphedLayer: a layer's forward and backward captured into graphs and
replayed, with several microbatches in flight (1F1B, interleaved VP).

How it differs from ``paddle.device.cuda.cuda_graphed_layer.CUDAGraphedLayer``
(Paddle 3.3.1):

* Parameters are inputs of the autograd function and their gradients are
  outputs of the backward graph, returned to autograd.  So backward runs and
  every parameter gets its gradient even where no input needs one
  (pipeline stage 0); upstream's queue grows by one entry per microbatch there.
* A backward finds its microbatch through the autograd context, not by FIFO
  order, and releases it: the queue holds only microbatches in flight.
* Any number of outputs (nested tuples/lists/dicts of tensors).
* All graphs of a model share one :class:`~.pool.GraphPool` (one memory
  pool) and are captured in the order they run.

The model of several microbatches in flight is the one of Transformer Engine's
``make_graphed_callables`` (one graph per microbatch position, captured in
the schedule's order, with that microbatch's own static inputs), found
lazily, without a declared order:

* A *cycle* is the stretch of work between two moments when no microbatch of
  the pool is in flight (a training step on pipeline stage 0; one microbatch
  on the last stage).  The n-th forward of a layer in a cycle uses that
  layer's graph pair n (:class:`~.state.GraphPair`).  Pair n is captured the
  first time it is needed, in run order.
* A pair is reused only after the backward that needs its buffers has run:
  a pair in flight is never refilled (``StaticBufferReuseError``) and a
  backward checks that its pair still holds its microbatch (a generation count).
* Within a cycle, graphs must replay in the order they were captured; that is
  what makes one shared memory pool safe (see :mod:`.pool`).  A replay out of
  that order raises ``GraphOrderError`` on both backends.

The phases, named as in ``torch.cuda.make_graphed_callables``, but run lazily
for each pair rather than once up front:

1. *checks*: every check of a forward or backward runs before any static
   buffer is written, so a refused call leaves the microbatches in flight intact;
2. *warmup*: eager runs, once per signature, results thrown away;
3. *capture forward*: the pair's first forward;
4. *capture backward*: the pair's first backward;
5. *replay*: every later forward and backward of the pair.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from .errors import CudaGraphError, SignatureChangeError, StaticBufferReuseError
from .pool import GraphPool
from .pytree import TreeSpec, flatten, unflatten
from .rng import RngState
from .state import GraphPair, Microbatch, Signature

__all__ = ["CUDAGraphedLayer"]


def _is_float(t: paddle.Tensor) -> bool:
    return t.dtype in (paddle.float16, paddle.float32, paddle.float64, paddle.bfloat16)


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"CUDAGraphedLayer: {name} must be an int >= {minimum}, got {value!r}.")


class _GraphedFunction(PyLayer):
    """Replay inside an autograd function: autograd sees one op whose inputs
    are the layer's input tensors and its trainable parameters, so backward
    runs (and parameters get gradients) even when no input needs a gradient."""

    @staticmethod
    def forward(ctx, owner, sig, *tensors):
        microbatch, outputs = owner._run_forward(sig, list(tensors[: sig.spec.num_leaves]))
        ctx.owner = owner
        ctx.microbatch = microbatch
        # Views of the static outputs: autograd must not take the buffers themselves as its own.
        views = [t.detach() for t in outputs]
        diff = set(microbatch.pair.out_diff)
        nondiff = [v for i, v in enumerate(views) if i not in diff]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(views) if len(views) != 1 else views[0]

    @staticmethod
    def backward(ctx, *dys):
        return ctx.owner._run_backward(ctx.microbatch, dys)


class CUDAGraphedLayer(paddle.nn.Layer):
    """Wrap ``layer`` so its training forward and backward run as captured graphs.

    Args:
        layer: the ``paddle.nn.Layer`` to graph.  Its forward must be capturable
            (no host synchronisation, no data-dependent control flow, fixed shapes
            per input signature).
        num_warmup_steps: eager forward+backward runs on the first microbatch of
            each new input signature before the first capture (lazy initialisation
            of kernels and workspaces).  Their results are discarded; parameters,
            their gradients, the layer's buffers and the RNG state (``paddle``'s
            and fleet's model-parallel tracker) are left as they were.  >= 0.
        pool: the :class:`GraphPool` shared with the other graphed layers of the
            same model; ``None`` gives this layer its own.
        backend: used only when ``pool`` is None: "auto" (CUDA graphs where
            Paddle can capture them, else the eager emulation), "cuda",
            "emulation" or a :class:`~paddle_hybrid.dygraph.cuda_graph.backends.GraphBackend`.
        max_graphs: most graph pairs per input signature, i.e. most microbatches of
            this layer in flight at once.  More raises :class:`CudaGraphError`
            (forwards whose backward never runs) instead of growing without bound.
        recapture: on a new input signature (shapes, dtypes, structure, which inputs
            need gradients, trainable parameters), capture new graphs (True) or
            raise :class:`SignatureChangeError` (False).
        max_signatures: most input signatures kept when ``recapture`` is True.

    Calls in eval mode, with gradients disabled, or where neither an input nor a
    parameter needs a gradient run ``layer`` eagerly.

    Outputs are views of the graph's fixed output buffers: valid until the
    backward of the same microbatch has run (clone them to keep them longer).
    """

    def __init__(
        self,
        layer: paddle.nn.Layer,
        num_warmup_steps: int = 3,
        pool: Optional[GraphPool] = None,
        backend="auto",
        max_graphs: int = 64,
        recapture: bool = True,
        max_signatures: int = 8,
    ):
        super().__init__()
        if not isinstance(layer, paddle.nn.Layer):
            raise TypeError(f"CUDAGraphedLayer: layer must be a paddle.nn.Layer, got {type(layer).__name__}.")
        _check_count("num_warmup_steps", num_warmup_steps, 0)
        _check_count("max_graphs", max_graphs, 1)
        _check_count("max_signatures", max_signatures, 1)
        if pool is not None and not isinstance(pool, GraphPool):
            raise TypeError(f"CUDAGraphedLayer: pool must be a GraphPool or None, got {type(pool).__name__}.")
        self.layer = layer
        self.num_warmup_steps = num_warmup_steps
        self.max_graphs = max_graphs
        self.recapture = bool(recapture)
        self.max_signatures = max_signatures
        self._pool = pool if pool is not None else GraphPool(backend)
        self._pool.layers.append(self)
        self._pairs: Dict[tuple, List[GraphPair]] = OrderedDict()  # signature key -> pair per position
        self._counts: Dict[tuple, Tuple[int, int]] = {}  # signature key -> (cycle, forwards in it)
        self._warmed: set = set()  # signature keys whose warmup ran
        self._out_specs: Dict[tuple, TreeSpec] = {}  # signature key -> nesting of the outputs
        self._queue: "OrderedDict[int, Microbatch]" = OrderedDict()
        self._seq = itertools.count()

    # -- introspection ---------------------------------------------------
    @property
    def pool(self) -> GraphPool:
        return self._pool

    def queue_length(self) -> int:
        """Microbatches of this layer whose backward has not run yet."""
        return len(self._queue)

    def num_graph_pairs(self) -> int:
        return sum(len(p) for p in self._pairs.values())

    def num_signatures(self) -> int:
        return len(self._pairs)

    @property
    def _name(self) -> str:
        return f"CUDAGraphedLayer({type(self.layer).__name__})"

    def _training_mode(self) -> bool:
        # PipelineLayer (1F1B) registers the wrapped layers, not this wrapper, as
        # its sublayers, so .eval() may reach only them: look at all of them.
        return self.training and all(l.training for l in self.layer.sublayers(include_self=True))

    # -- entry -------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if not self._training_mode() or not paddle.is_grad_enabled():
            return self.layer(*args, **kwargs)
        leaves, spec = flatten((args, kwargs))
        params = [p for p in self.layer.parameters() if not p.stop_gradient]
        if not params and all(t.stop_gradient for t in leaves):
            return self.layer(*args, **kwargs)  # no backward will come to release a pair
        sig = Signature(spec, leaves, params)
        out = _GraphedFunction.apply(self, sig, *leaves, *params)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        return unflatten(self._out_specs[sig.key], flat)

    def _run_forward(self, sig: Signature, leaves: List[paddle.Tensor]):
        """The forward of one microbatch; its record and the static outputs."""
        # 1. checks (the order check also records the replay in the pool)
        pair = self._pair_for_next_forward(sig, leaves)
        self._check_pair_free(pair)
        if pair.fwd is not None:
            self._pool.before_replay(pair.fwd_position, f"forward graph {pair.index} of {self._name}")
        pair.fill_inputs(leaves)  # only now: a refused call must not touch a pair in flight
        if pair.fwd is None:
            if sig.key not in self._warmed:
                self._warmup(sig, pair)  # 2. warmup
                self._warmed.add(sig.key)
            self._capture_forward(sig, pair)  # 3. capture forward
        else:
            pair.fwd.replay()  # 5. replay
        microbatch = Microbatch(next(self._seq), sig, pair, pair.start())
        self._queue[microbatch.seq] = microbatch
        self._pool.microbatch_started()
        return microbatch, pair.fwd.outputs

    def _run_backward(self, microbatch: Microbatch, dys) -> tuple:
        """The backward of one microbatch: gradients for autograd, one per
        tensor given to :class:`_GraphedFunction` (inputs, then parameters)."""
        pair = microbatch.pair
        # 1. checks
        self._check_backward(microbatch)
        if pair.bwd is not None:
            self._pool.before_replay(pair.bwd_position, f"backward graph {pair.index} of {self._name}")
        pair.fill_output_grads(dys)
        if pair.bwd is None:
            self._capture_backward(microbatch.sig, pair)  # 4. capture backward
        else:
            pair.bwd.replay()  # 5. replay
        grads = self._gradients_for_autograd(microbatch.sig, pair)
        # Released only after the gradients were copied out of the pair's buffers.
        microbatch.done = True
        pair.release()
        self._queue.pop(microbatch.seq, None)
        self._pool.microbatch_finished()
        return grads

    # -- 1. checks ------------------------------------------------------------
    def _pair_for_next_forward(self, sig: Signature, leaves) -> GraphPair:
        """Pair n for the n-th forward of this signature in the cycle, made
        (without graphs) if this is the first cycle with that many forwards."""
        pairs = self._pairs_for(sig)
        index = self._position_in_cycle(sig)
        if index < len(pairs):
            return pairs[index]
        if index >= self.max_graphs:
            raise CudaGraphError(
                f"{self._name}: {index + 1} microbatches in "
                f"flight, more than max_graphs={self.max_graphs}. Backward never ran for "
                f"{self.queue_length()} earlier forwards: run backward for every training "
                "forward (or call it under paddle.no_grad()/eval()), or raise max_graphs for "
                "a schedule with more microbatches in flight."
            )
        pairs.append(GraphPair.for_inputs(index, leaves))
        return pairs[index]

    def _pairs_for(self, sig: Signature) -> List[GraphPair]:
        pairs = self._pairs.get(sig.key)
        if pairs is not None:
            return pairs
        if self._pairs and not self.recapture:
            raise SignatureChangeError(
                f"{self._name}: inputs changed to "
                f"{sig.describe()}; the graphs were captured for another signature and "
                "recapture=False. Keep shapes/dtypes fixed (pad batches) or pass recapture=True."
            )
        if len(self._pairs) >= self.max_signatures:
            raise SignatureChangeError(
                f"{self._name}: more than "
                f"max_signatures={self.max_signatures} input signatures; the latest is "
                f"{sig.describe()}. Shapes that change every step defeat graph capture: "
                "pad to a few fixed shapes or raise max_signatures."
            )
        return self._pairs.setdefault(sig.key, [])

    def _position_in_cycle(self, sig: Signature) -> int:
        """How many forwards of this signature ran before this one in the pool's cycle."""
        cycle, count = self._counts.get(sig.key, (self._pool.cycle, 0))
        if cycle != self._pool.cycle:
            count = 0
        self._counts[sig.key] = (self._pool.cycle, count + 1)
        return count

    def _check_pair_free(self, pair: GraphPair) -> None:
        if pair.in_flight:
            raise StaticBufferReuseError(
                f"{self._name}: graph pair {pair.index} still holds a "
                "microbatch whose backward has not run; refilling its static buffers now would "
                "give that backward another microbatch's data."
            )

    def _check_backward(self, microbatch: Microbatch) -> None:
        if microbatch.done:
            raise CudaGraphError(f"{self._name}: backward ran twice for one microbatch.")
        self._check_pair_holds(microbatch)
        if microbatch.pair.fwd is None:
            raise CudaGraphError(
                f"{self._name}: backward of a microbatch whose graphs were dropped "
                "(GraphPool.reset() while it was in flight)."
            )

    def _check_pair_holds(self, microbatch: Microbatch) -> None:
        pair = microbatch.pair
        if not pair.holds(microbatch.generation):
            raise StaticBufferReuseError(
                f"{self._name}: the static buffers of graph pair {pair.index} were refilled "
                f"by another microbatch (generation {pair.generation}, this one {microbatch.generation}) "
                "before this backward ran; its gradients would be those of the other microbatch."
            )

    # -- 2. warmup ------------------------------------------------------------
    def _warmup(self, sig: Signature, pair: GraphPair) -> None:
        """Eager forward+backward runs on the pair's static inputs, so lazy
        initialisation happens before capture, not inside it.  Whatever they
        change that a plain step would not is put back: the layer's buffers
        (e.g. BatchNorm statistics) and the random state (dropout)."""
        if self.num_warmup_steps == 0:
            return
        rng = RngState()
        buffers = [(b, b.detach().clone()) for b in self.layer.buffers() if b is not None]
        try:
            for _ in range(self.num_warmup_steps):
                self._warmup_once(sig, pair)
        finally:
            try:
                with paddle.no_grad():
                    for b, saved in buffers:
                        paddle.assign(saved, output=b)
            finally:  # the random state even if a buffer could not be put back
                rng.restore()

    def _warmup_once(self, sig: Signature, pair: GraphPair) -> None:
        flat, _ = self._call_layer(sig, pair.static_inputs)
        roots = [t for t in flat if _is_float(t) and not t.stop_gradient]
        if roots:
            # paddle.grad, not backward(): parameters' .grad must stay as they are.
            paddle.grad(roots, self._grad_targets(sig, pair),
                        grad_outputs=[paddle.ones_like(r) for r in roots], allow_unused=True)

    def _call_layer(self, sig: Signature, static_inputs) -> Tuple[List[paddle.Tensor], TreeSpec]:
        """Run the layer on the static inputs, rebuilt into the call's nesting."""
        args, kwargs = unflatten(sig.spec, static_inputs)
        # The autograd function's forward runs under no_grad; the capture
        # needs the layer's autograd graph for the backward graph.
        with paddle.enable_grad():
            out = self.layer(*args, **kwargs)
        return flatten(out)

    def _grad_targets(self, sig: Signature, pair: GraphPair) -> List[paddle.Tensor]:
        """What the backward graph differentiates for: inputs that need a gradient, then parameters."""
        return [t for t in pair.static_inputs if not t.stop_gradient] + list(sig.params)

    # -- 3. capture forward -----------------------------------------------
    def _capture_forward(self, sig: Signature, pair: GraphPair) -> None:
        def body():
            flat, out_spec = self._call_layer(sig, pair.static_inputs)
            if out_spec.refs:
                kinds = sorted({type(v).__name__ for v in out_spec.refs.values()})
                raise CudaGraphError(
                    f"{self._name}: the layer returned {', '.join(kinds)}, neither a tensor nor a "
                    "hashable constant; a graph can only give back tensors (and constants fixed at capture)."
                )
            self._out_specs[sig.key] = out_spec
            return flat

        pair.fwd, pair.fwd_position = self._pool.capture(body)
        outs = pair.fwd.autograd_outputs()
        pair.out_diff = [i for i, t in enumerate(outs) if _is_float(t) and not t.stop_gradient]

    # -- 4. capture backward ----------------------------------------------
    def _capture_backward(self, sig: Signature, pair: GraphPair) -> None:
        targets = self._grad_targets(sig, pair)

        def body():
            # The forward's autograd graph: on CUDA the captured one; in the
            # emulation the one of the forward's last replay (see backends).
            outs = pair.fwd.autograd_outputs()
            roots = [outs[i] for i in pair.out_diff]
            return list(paddle.grad(roots, targets, grad_outputs=pair.static_dys, allow_unused=True))

        pair.bwd, pair.bwd_position = self._pool.capture(body)

    # -- 5. replay: what goes back to autograd --------------------------------
    def _gradients_for_autograd(self, sig: Signature, pair: GraphPair) -> tuple:
        grads = pair.bwd.outputs
        n_in_grad = sum(sig.input_needs_grad)
        in_grads = iter(grads[:n_in_grad])
        result = []
        with paddle.no_grad():
            # Copies: autograd may keep a returned tensor as a parameter's .grad,
            # and the next replay overwrites the fixed buffers.
            for needs, s in zip(sig.input_needs_grad, pair.static_inputs):
                if not needs:
                    result.append(None)
                    continue
                g = next(in_grads)
                result.append(paddle.zeros(s.shape, dtype=s.dtype) if g is None else g.clone())
            for g in grads[n_in_grad:]:
                result.append(None if g is None else g.clone())
        return tuple(result)

    # -- reset (GraphPool.reset) -----------------------------------------------
    def _drop_graphs(self) -> None:
        for pairs in self._pairs.values():
            for p in pairs:
                p.reset()
        self._pairs.clear()
        self._counts.clear()
        self._warmed.clear()
        self._queue.clear()
        self._out_specs.clear()
