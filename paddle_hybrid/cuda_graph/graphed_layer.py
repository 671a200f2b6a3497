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
* All graphs of a model share one :class:`GraphPool` (one memory pool) and are
  captured in the order they run.

The model of several microbatches in flight is the one of Transformer Engine's
``make_graphed_callables`` (one graph per microbatch position, captured in
the schedule's order, with that microbatch's own static inputs), found
lazily, without a declared order:

* A *cycle* is the stretch of work between two moments when no microbatch of
  the pool is in flight (a training step on pipeline stage 0; one microbatch
  on the last stage).  The n-th forward of a layer in a cycle uses that
  layer's graph pair n: fixed inputs, forward graph, fixed output gradients,
  backward graph.  Pair n is captured the first time it is needed, in run order.
* A pair is reused only after the backward that needs its buffers has run:
  a pair in flight is never refilled (``StaticBufferReuseError``) and a
  backward checks that its pair still holds its microbatch (a generation count).
* Within a cycle, graphs must replay in the order they were captured; that is
  what makes one shared memory pool safe (memory a graph freed during its
  capture may belong to a graph captured later).  A replay out of that order
  raises ``GraphOrderError`` on both backends.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from .backends import GraphBackend, resolve_backend

__all__ = [
    "CUDAGraphedLayer",
    "GraphPool",
    "CudaGraphError",
    "StaticBufferReuseError",
    "GraphOrderError",
    "SignatureChangeError",
]


class CudaGraphError(RuntimeError):
    """Misuse of a graphed layer."""


class StaticBufferReuseError(CudaGraphError):
    """A graph's static buffers would be (or were) refilled before the backward
    of the microbatch that owns them."""


class GraphOrderError(CudaGraphError):
    """Graphs sharing a memory pool replayed out of their capture order."""


class SignatureChangeError(CudaGraphError):
    """Inputs changed shape/dtype/structure and re-capture is disabled."""


# ---------------------------------------------------------------------------
# pytrees of tensors
# ---------------------------------------------------------------------------
_TENSOR = object()


def _flatten(obj, leaves: list):
    """Return a hashable description of ``obj``'s structure; append tensors to ``leaves``."""
    if isinstance(obj, paddle.Tensor):
        leaves.append(obj)
        return _TENSOR
    if isinstance(obj, tuple):
        return ("t", tuple(_flatten(o, leaves) for o in obj))
    if isinstance(obj, list):
        return ("l", tuple(_flatten(o, leaves) for o in obj))
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return ("d", keys, tuple(_flatten(obj[k], leaves) for k in keys))
    try:
        hash(obj)
        return ("c", obj)
    except TypeError:
        return ("c", ("unhashable", type(obj).__name__, id(obj)))


def _unflatten(spec, leaves_iter):
    if spec is _TENSOR:
        return next(leaves_iter)
    kind = spec[0]
    if kind == "t":
        return tuple(_unflatten(s, leaves_iter) for s in spec[1])
    if kind == "l":
        return [_unflatten(s, leaves_iter) for s in spec[1]]
    if kind == "d":
        return {k: _unflatten(s, leaves_iter) for k, s in zip(spec[1], spec[2])}
    value = spec[1]
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "unhashable":
        raise CudaGraphError("internal: unhashable constant cannot be rebuilt")
    return value


def _constant_objects(obj, out: dict):
    """Unhashable non-tensor leaves, by id, so they can be rebuilt by reference."""
    if isinstance(obj, (tuple, list)):
        for o in obj:
            _constant_objects(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _constant_objects(o, out)
    elif not isinstance(obj, paddle.Tensor):
        try:
            hash(obj)
        except TypeError:
            out[id(obj)] = obj


def _is_float(t: paddle.Tensor) -> bool:
    return t.dtype in (paddle.float16, paddle.float32, paddle.float64, paddle.bfloat16)


# ---------------------------------------------------------------------------
# pool: one per model
# ---------------------------------------------------------------------------
class GraphPool:
    """What all graphed layers of one model share: the backend, its memory
    pool, the capture order and the count of microbatches in flight.

    ``backend``: "auto", "cuda", "emulation" or a :class:`GraphBackend`.
    """

    def __init__(self, backend="auto"):
        self.backend: GraphBackend = resolve_backend(backend)
        self._pool_handle = None
        self._pool_made = False
        self._next_position = itertools.count()
        self._last_position = -1
        self.cycle = 0
        self.in_flight = 0
        self.layers: List["CUDAGraphedLayer"] = []
        # Test hook: the order check can be turned off to show what it prevents.
        self._check_order = True

    @property
    def handle(self):
        if not self._pool_made:
            self._pool_handle = self.backend.new_pool()
            self._pool_made = True
        return self._pool_handle

    def capture(self, body) -> Tuple[Any, int]:
        graph = self.backend.capture(body, self.handle)
        position = next(self._next_position)
        self._last_position = position
        return graph, position

    def check_replay_order(self, position: int, what: str) -> None:
        if position <= self._last_position and self._check_order:
            raise GraphOrderError(
                f"{what} would replay out of capture order in this cycle (captured at "
                f"position {position}, a graph captured at {self._last_position} already ran). "
                "Graphs that share one memory pool must replay in the order they were captured, "
                "so the schedule must be the same every step. If it changed on purpose (other "
                "number of microbatches or pipeline schedule), call reset() on the pool of the "
                "model between steps to capture again."
            )
        self._last_position = position

    def _started(self) -> None:
        self.in_flight += 1

    def _finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.cycle += 1
            self._last_position = -1

    def reset(self) -> None:
        """Drop every graph of every layer and forget the capture order.

        Microbatches still in flight are abandoned (their backward would
        raise).  The next cycle captures again."""
        for layer in self.layers:
            layer._drop_graphs()
        self._next_position = itertools.count()
        self._last_position = -1
        self.in_flight = 0
        self.cycle += 1
        self._pool_handle = None
        self._pool_made = False


# ---------------------------------------------------------------------------
# per-microbatch-position graph pair
# ---------------------------------------------------------------------------
class _GraphPair:
    IDLE = "idle"
    IN_FLIGHT = "in_flight"

    def __init__(self, index: int, static_inputs: List[paddle.Tensor]):
        self.index = index
        self.static_inputs = static_inputs
        self.fwd = None
        self.fwd_position = -1
        self.out_diff: List[int] = []  # positions of differentiable outputs
        self.static_dys: Optional[List[paddle.Tensor]] = None
        self.bwd = None
        self.bwd_position = -1
        self.state = self.IDLE
        self.generation = 0

    def reset(self):
        for g in (self.fwd, self.bwd):
            if g is not None:
                g.reset()
        self.fwd = self.bwd = None
        self.static_dys = None
        self.static_inputs = []


class _Signature:
    __slots__ = ("spec", "metas", "params", "key", "constants")

    def __init__(self, spec, metas, params, constants):
        self.spec = spec
        self.metas = metas
        self.params = params
        self.constants = constants
        self.key = (spec, metas, tuple(id(p) for p in params))

    def describe(self) -> str:
        shapes = ", ".join(f"{list(s)}:{d}{'' if sg else ':grad'}" for s, d, sg in self.metas)
        return f"[{shapes}] with {len(self.params)} trainable parameters"


class _Entry:
    """One microbatch in flight: its pair and the pair's generation at fill."""

    __slots__ = ("seq", "pair", "generation", "sig", "n_inputs", "input_needs_grad", "done")

    def __init__(self, seq, pair, generation, sig, n_inputs, input_needs_grad):
        self.seq = seq
        self.pair = pair
        self.generation = generation
        self.sig = sig
        self.n_inputs = n_inputs
        self.input_needs_grad = input_needs_grad
        self.done = False


def _rng_snapshot():
    state = paddle.get_rng_state()
    tracker = None
    try:
        from paddle.distributed.fleet.meta_parallel.parallel_layers.random import get_rng_state_tracker

        tracker = get_rng_state_tracker().get_states_tracker()
    except Exception:  # no fleet RNG tracker in this build
        tracker = None
    return state, tracker


def _rng_restore(snapshot):
    state, tracker = snapshot
    paddle.set_rng_state(state)
    if tracker is not None:
        from paddle.distributed.fleet.meta_parallel.parallel_layers.random import get_rng_state_tracker

        get_rng_state_tracker().set_states_tracker(tracker)


class _GraphedFunction(PyLayer):
    @staticmethod
    def forward(ctx, owner, call, *tensors):
        sig, n_leaves, input_needs_grad = call
        entry, outputs = owner._forward_graphed(sig, list(tensors[:n_leaves]), input_needs_grad)
        ctx.owner = owner
        ctx.entry = entry
        views = [t.detach() for t in outputs]
        diff = set(entry.pair.out_diff)
        nondiff = [v for i, v in enumerate(views) if i not in diff]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(views) if len(views) != 1 else views[0]

    @staticmethod
    def backward(ctx, *dys):
        return ctx.owner._backward_graphed(ctx.entry, dys)


# ---------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------
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
            "emulation" or a :class:`~paddle_hybrid.cuda_graph.backends.GraphBackend`.
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
        if isinstance(num_warmup_steps, bool) or not isinstance(num_warmup_steps, int) or num_warmup_steps < 0:
            raise ValueError(f"CUDAGraphedLayer: num_warmup_steps must be an int >= 0, got {num_warmup_steps!r}.")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"CUDAGraphedLayer: max_graphs must be an int >= 1, got {max_graphs!r}.")
        if isinstance(max_signatures, bool) or not isinstance(max_signatures, int) or max_signatures < 1:
            raise ValueError(f"CUDAGraphedLayer: max_signatures must be an int >= 1, got {max_signatures!r}.")
        if pool is not None and not isinstance(pool, GraphPool):
            raise TypeError(f"CUDAGraphedLayer: pool must be a GraphPool or None, got {type(pool).__name__}.")
        self.layer = layer
        self.num_warmup_steps = num_warmup_steps
        self.max_graphs = max_graphs
        self.recapture = bool(recapture)
        self.max_signatures = max_signatures
        pool = pool if pool is not None else GraphPool(backend)
        object.__setattr__(self, "_pool", pool)
        pool.layers.append(self)
        self._pairs: Dict[Any, List[_GraphPair]] = OrderedDict()
        self._counts: Dict[Any, Tuple[int, int]] = {}
        self._warmed: set = set()
        self._out_specs: Dict[Any, Any] = {}  # signature key -> output structure
        self._queue: "OrderedDict[int, _Entry]" = OrderedDict()
        self._seq = itertools.count()
        # Test hook: the reuse checks can be turned off to show what they prevent.
        self._check_reuse = True

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

    def _training_mode(self) -> bool:
        # PipelineLayer (1F1B) registers the wrapped layers, not this wrapper, as
        # its sublayers, so .eval() may reach only them: look at all of them.
        return self.training and all(l.training for l in self.layer.sublayers(include_self=True))

    # -- forward ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        if not self._training_mode() or not paddle.is_grad_enabled():
            return self.layer(*args, **kwargs)
        leaves: list = []
        spec = _flatten((args, kwargs), leaves)
        params = [p for p in self.layer.parameters() if not p.stop_gradient]
        input_needs_grad = [not t.stop_gradient for t in leaves]
        if not params and not any(input_needs_grad):
            return self.layer(*args, **kwargs)
        constants: dict = {}
        _constant_objects((args, kwargs), constants)
        metas = tuple((tuple(t.shape), str(t.dtype), bool(t.stop_gradient)) for t in leaves)
        sig = _Signature(spec, metas, params, constants)
        call = (sig, len(leaves), input_needs_grad)
        out = _GraphedFunction.apply(self, call, *leaves, *params)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        pair_spec = self._out_specs[sig.key]
        return _unflatten(pair_spec, iter(flat))

    def _pairs_for(self, sig: _Signature) -> List[_GraphPair]:
        pairs = self._pairs.get(sig.key)
        if pairs is not None:
            return pairs
        if self._pairs:
            if not self.recapture:
                raise SignatureChangeError(
                    f"CUDAGraphedLayer({type(self.layer).__name__}): inputs changed to "
                    f"{sig.describe()}; the graphs were captured for another signature and "
                    "recapture=False. Keep shapes/dtypes fixed (pad batches) or pass recapture=True."
                )
            if len(self._pairs) >= self.max_signatures:
                raise SignatureChangeError(
                    f"CUDAGraphedLayer({type(self.layer).__name__}): more than "
                    f"max_signatures={self.max_signatures} input signatures; the latest is "
                    f"{sig.describe()}. Shapes that change every step defeat graph capture: "
                    "pad to a few fixed shapes or raise max_signatures."
                )
        pairs = []
        self._pairs[sig.key] = pairs
        return pairs

    def _next_index(self, sig: _Signature) -> int:
        cycle, count = self._counts.get(sig.key, (self._pool.cycle, 0))
        if cycle != self._pool.cycle:
            count = 0
        self._counts[sig.key] = (self._pool.cycle, count + 1)
        return count

    def _rebuild_args(self, sig: _Signature, tensors):
        it = iter(tensors)

        def rebuild(spec):
            if spec is _TENSOR:
                return next(it)
            kind = spec[0]
            if kind == "t":
                return tuple(rebuild(s) for s in spec[1])
            if kind == "l":
                return [rebuild(s) for s in spec[1]]
            if kind == "d":
                return {k: rebuild(s) for k, s in zip(spec[1], spec[2])}
            value = spec[1]
            if isinstance(value, tuple) and len(value) == 3 and value[0] == "unhashable":
                return sig.constants[value[2]]
            return value

        args, kwargs = rebuild(sig.spec)
        return args, kwargs

    def _run_layer(self, sig, static_inputs):
        args, kwargs = self._rebuild_args(sig, static_inputs)
        with paddle.enable_grad():
            out = self.layer(*args, **kwargs)
        flat: list = []
        out_spec = _flatten(out, flat)
        return out_spec, flat

    def _grad_targets(self, sig, pair):
        inputs = [t for t in pair.static_inputs if not t.stop_gradient]
        return inputs + list(sig.params)

    def _warmup(self, sig, pair):
        if self.num_warmup_steps == 0:
            return
        rng = _rng_snapshot()
        buffers = [(b, b.detach().clone()) for b in self.layer.buffers() if b is not None]
        try:
            for _ in range(self.num_warmup_steps):
                _, flat = self._run_layer(sig, pair.static_inputs)
                roots = [t for t in flat if _is_float(t) and not t.stop_gradient]
                if roots:
                    paddle.grad(roots, self._grad_targets(sig, pair),
                                grad_outputs=[paddle.ones_like(r) for r in roots], allow_unused=True)
                del flat, roots
        finally:
            _rng_restore(rng)
            with paddle.no_grad():
                for b, saved in buffers:
                    paddle.assign(saved, output=b)

    def _forward_graphed(self, sig, leaves, input_needs_grad):
        pairs = self._pairs_for(sig)
        index = self._next_index(sig)
        if index >= len(pairs):
            if index >= self.max_graphs:
                raise CudaGraphError(
                    f"CUDAGraphedLayer({type(self.layer).__name__}): {index + 1} microbatches in "
                    f"flight, more than max_graphs={self.max_graphs}. Backward never ran for "
                    f"{self.queue_length()} earlier forwards: run backward for every training "
                    "forward (or call it under paddle.no_grad()/eval()), or raise max_graphs for "
                    "a schedule with more microbatches in flight."
                )
            with paddle.no_grad():
                statics = []
                for t in leaves:
                    s = paddle.empty(t.shape, dtype=t.dtype)
                    s.stop_gradient = t.stop_gradient
                    statics.append(s)
            pairs.append(_GraphPair(index, statics))
        pair = pairs[index]
        if pair.state == _GraphPair.IN_FLIGHT and self._check_reuse:
            raise StaticBufferReuseError(
                f"CUDAGraphedLayer({type(self.layer).__name__}): graph pair {index} still holds a "
                "microbatch whose backward has not run; refilling its static buffers now would "
                "give that backward another microbatch's data."
            )
        if pair.fwd is not None:  # every check before any buffer is touched
            self._pool.check_replay_order(pair.fwd_position, f"forward graph {index} of {type(self.layer).__name__}")
        with paddle.no_grad():
            for s, t in zip(pair.static_inputs, leaves):
                paddle.assign(t.detach(), output=s)
        if pair.fwd is None:
            if sig.key not in self._warmed:
                self._warmup(sig, pair)
                self._warmed.add(sig.key)
            holder = {}

            def body():
                spec, flat = self._run_layer(sig, pair.static_inputs)
                holder["spec"] = spec
                for t in flat:
                    if not isinstance(t, paddle.Tensor):
                        raise CudaGraphError("internal: non-tensor output leaf")
                return flat

            pair.fwd, pair.fwd_position = self._pool.capture(body)
            self._out_specs[sig.key] = holder["spec"]
            outs = pair.fwd.autograd_outputs()
            pair.out_diff = [i for i, t in enumerate(outs) if _is_float(t) and not t.stop_gradient]
        else:
            pair.fwd.replay()
        pair.state = _GraphPair.IN_FLIGHT
        pair.generation += 1
        entry = _Entry(next(self._seq), pair, pair.generation, sig, len(leaves), input_needs_grad)
        self._queue[entry.seq] = entry
        self._pool._started()
        return entry, pair.fwd.outputs

    # -- backward --------------------------------------------------------
    def _backward_graphed(self, entry: _Entry, dys):
        pair = entry.pair
        name = type(self.layer).__name__
        if entry.done:
            raise CudaGraphError(f"CUDAGraphedLayer({name}): backward ran twice for one microbatch.")
        if self._check_reuse and (pair.generation != entry.generation or pair.state != _GraphPair.IN_FLIGHT):
            raise StaticBufferReuseError(
                f"CUDAGraphedLayer({name}): the static buffers of graph pair {pair.index} were refilled "
                f"by another microbatch (generation {pair.generation}, this one {entry.generation}) "
                "before this backward ran; its gradients would be those of the other microbatch."
            )
        if pair.fwd is None:
            raise CudaGraphError(
                f"CUDAGraphedLayer({name}): backward of a microbatch whose graphs were dropped "
                "(GraphPool.reset() while it was in flight)."
            )
        sig = entry.sig
        diff = pair.out_diff
        if pair.bwd is not None:
            self._pool.check_replay_order(pair.bwd_position, f"backward graph {pair.index} of {name}")
        with paddle.no_grad():
            if pair.static_dys is None:
                pair.static_dys = [paddle.zeros(pair.fwd.outputs[i].shape, dtype=pair.fwd.outputs[i].dtype)
                                   for i in diff]
            for s, i in zip(pair.static_dys, diff):
                dy = dys[i] if i < len(dys) else None
                if dy is None:
                    s.zero_()
                else:
                    paddle.assign(dy.detach(), output=s)
        if pair.bwd is None:
            targets = self._grad_targets(sig, pair)

            def body():
                outs = pair.fwd.autograd_outputs()
                roots = [outs[i] for i in diff]
                grads = paddle.grad(roots, targets, grad_outputs=pair.static_dys, allow_unused=True)
                return list(grads)

            pair.bwd, pair.bwd_position = self._pool.capture(body)
        else:
            pair.bwd.replay()
        grads = pair.bwd.outputs
        n_in_grad = sum(1 for t in pair.static_inputs if not t.stop_gradient)
        in_grads = iter(grads[:n_in_grad])
        param_grads = grads[n_in_grad:]
        result = []
        with paddle.no_grad():
            # Copies: autograd may keep a returned tensor as a parameter's .grad,
            # and the next replay overwrites the fixed buffers.
            for needs, s in zip(entry.input_needs_grad, pair.static_inputs):
                if not needs:
                    result.append(None)
                    continue
                g = next(in_grads)
                result.append(paddle.zeros(s.shape, dtype=s.dtype) if g is None else g.clone())
            for g in param_grads:
                result.append(None if g is None else g.clone())
        entry.done = True
        pair.state = _GraphPair.IDLE
        self._queue.pop(entry.seq, None)
        self._pool._finished()
        return tuple(result)

    # -- reset -----------------------------------------------------------
    def _drop_graphs(self):
        for pairs in self._pairs.values():
            for p in pairs:
                p.reset()
        self._pairs.clear()
        self._counts.clear()
        self._warmed.clear()
        self._queue.clear()
        self._out_specs.clear()
