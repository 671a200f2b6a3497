"""Recompute on CPU with the random state of the forward replayed in the recompute.

A dropout inside a recomputed block must draw in the recompute the mask it drew in
the forward, else the gradient belongs to another network.  Fleet keeps that promise
by saving Paddle's generator state, the model-parallel ``RNGStatesTracker``'s states,
NumPy's and Python's before the forward and switching to them for the recompute
(``recompute.switch_rng_state_tracker``).  On a CPU build that machinery itself works
(the CPU generator's state and the tracker's state indices can be read and set back:
checked by the tests); what stops is a device gate and two ``.cuda()`` calls:

1. ``recompute_hybrid._HPRecomputeFunction.forward``: fleet's hybrid (model-parallel
   aware) recompute, reached through ``recompute_hybrid`` and through every
   ``PipelineLayer(recompute_interval > 0)``, fails on its first call with
   ``AssertionError: Recompute with RNG is not support current device: cpu.``
   Patch: on a CPU place our own forward stores what the stock backward reads (the
   same random states, AMP state, inputs, optionally partitioned over the mp group)
   without the gate; other places go to the stock forward.  ``offload=True`` is
   recorded as False on CPU: the activations already are in host memory, and the
   stock backward would move them back with ``.cuda()`` (``ValueError: No available
   device found.``).  With ``partition=True`` our forward keeps its slice of a
   flattened *copy*: the stock ``_split_activation`` flattens the caller's tensor in
   place (``flatten_`` on a ``detach()`` sharing it), which reshapes the caller's
   activation and bumps its inplace version, so a backward node that saved it failed
   ("Tensor '' used in gradient computation has been modified by an inplace
   operation", seen with a tanh in front of the block).
2. ``recompute_hybrid._merge_activation``: with ``partition=True`` and an mp group of
   2 or more ranks, the backward all-gathers the activation from ``tensor.cuda()``,
   which fails the same way on CPU.  Patch: a CPU tensor is gathered where it is
   (gloo gathers host memory); other tensors take the stock path.

Checked and left alone: plain ``fleet.utils.recompute`` (both the re-entrant
``RecomputeFunction`` and ``use_reentrant=False``) saves and restores
``paddle.get_rng_state()`` of the current place, which on CPU is the CPU generator, so
dropout masks already match there.
"""
from __future__ import annotations

import functools
import importlib
import random

__all__ = ["apply"]

_FORWARD_PARAMS = ["ctx", "run_function", "all_outputs", "mp_group", "offload", "partition",
                   "custom_get_state_func", "custom_set_state_func", "args", "kwargs"]


def _on_cpu() -> bool:
    import paddle

    return paddle.get_device().split(":")[0] == "cpu"


def _record_random_states(ctx, custom_get_state_func, custom_set_state_func):
    """Everything the stock backward hands to ``switch_rng_state_tracker``."""
    import numpy as np
    import paddle
    from paddle.distributed.fleet.meta_parallel.parallel_layers.random import get_rng_state_tracker

    ctx.fwd_rng_state = paddle.get_rng_state()  # on CPU: [CPU generator state], a snapshot
    ctx.fwd_rng_state_tracker = get_rng_state_tracker().get_states_tracker()
    ctx.fwd_numpy_state = np.random.get_state()
    ctx.fwd_random_state = random.getstate()
    ctx.fwd_custom_state = custom_get_state_func()
    ctx.custom_get_state_func = custom_get_state_func
    ctx.custom_set_state_func = custom_set_state_func


def _record_amp(ctx):
    """The autocast state of the forward, which the stock backward re-enters."""
    from paddle import framework
    from paddle.framework import core

    tracer = framework._dygraph_tracer()
    level = tracer._amp_level
    if level not in (core.AmpLevel.O0, core.AmpLevel.O1, core.AmpLevel.O2):
        raise ValueError(f"paddle_hybrid.cpu: recompute does not know AMP level {level}.")
    ctx.is_fw_autocast = level != core.AmpLevel.O0
    # O0 is recorded as "O1": it is only used when autocast is on.
    ctx.amp_level = "O2" if level == core.AmpLevel.O2 else "O1"
    ctx.amp_dtype = tracer._amp_dtype
    ctx.amp_white_list, ctx.amp_black_list = tracer._get_amp_op_list()


def _own_slice(tensor, mp_group):
    """This rank's 1/n of the flattened activation, as a copy (what the stock backward's
    ``_merge_activation`` gathers back).  Unlike the stock ``_split_activation`` it does
    not flatten the caller's tensor in place: that changed the caller's shape and bumped
    its inplace version, so a backward node that saved it (e.g. a tanh before the block)
    failed with "Tensor ... has been modified by an inplace operation"."""
    n = mp_group.nranks
    if n < 2:
        return tensor.detach().clone()
    numel = int(tensor.numel())
    if numel == 0 or numel % n:
        raise ValueError(f"paddle_hybrid.cpu: recompute partition needs an activation whose size "
                         f"({numel}) is a nonzero multiple of the mp degree ({n}).")
    part = numel // n
    start = part * mp_group.rank
    return tensor.detach().reshape([-1])[start:start + part].clone()


def _save_inputs(ctx, args, partition, mp_group):
    """Tensors go through ``save_for_backward`` (our slice of them with ``partition``);
    everything else is kept as is in ``ctx.inputs``, with None where a tensor goes."""
    import paddle
    from paddle import framework

    ctx.inputs, ctx.tensor_indices, ctx.tensor_shapes = [], [], []
    saved = []
    for i, arg in enumerate(args):
        if not paddle.is_tensor(arg):
            ctx.inputs.append(arg)
            continue
        stop_gradient = arg.stop_gradient
        kept = arg
        if partition:
            ctx.tensor_shapes.append(arg.shape)
            kept = _own_slice(arg, mp_group)
            kept.stop_gradient = stop_gradient
        saved.append(kept)
        ctx.tensor_indices.append(i)
        ctx.inputs.append(None)
        # An output that *is* an input with stop_gradient=True would otherwise be made
        # differentiable by PyLayer (and then clash with in-place use).
        if stop_gradient and framework.in_dynamic_mode():
            ctx.mark_non_differentiable(arg)
    ctx.save_for_backward(*saved)


def _make_forward(stock_forward):
    @functools.wraps(stock_forward)
    def forward(ctx, run_function, all_outputs, mp_group, offload, partition,
                custom_get_state_func, custom_set_state_func, *args, **kwargs):
        if not _on_cpu():
            return stock_forward(ctx, run_function, all_outputs, mp_group, offload, partition,
                                 custom_get_state_func, custom_set_state_func, *args, **kwargs)
        import paddle

        # States first: the forward below consumes random numbers.
        _record_random_states(ctx, custom_get_state_func, custom_set_state_func)
        _record_amp(ctx)
        ctx.run_function = run_function
        ctx.kwargs = kwargs
        ctx.mp_group = mp_group
        ctx.partition = partition
        ctx.offload = False  # host memory already; see the module docstring

        with paddle.no_grad():
            outputs = run_function(*args, **kwargs)
        _save_inputs(ctx, args, partition, mp_group)

        # recompute_hybrid returns what it finds in all_outputs (the PyLayer's own
        # outputs lose stop_gradient information for non-float tensors).
        if paddle.is_tensor(outputs):
            all_outputs.append(outputs)
            return outputs
        all_outputs.extend(outputs)
        return tuple(outputs)

    return forward


def _make_merge(stock_merge):
    @functools.wraps(stock_merge)
    def _merge_activation(tensor, mp_group):
        if mp_group.nranks < 2 or not tensor.place.is_cpu_place():
            return stock_merge(tensor, mp_group)
        import paddle

        shape = list(tensor.shape)
        shape[0] *= mp_group.nranks
        out = paddle.empty(shape, tensor.dtype)
        mp_group.process_group.all_gather(tensor, out).wait()
        return out

    return _merge_activation


def apply(patcher) -> None:
    # By module path: the package re-exports functions under the same names.
    mp_random = importlib.import_module("paddle.distributed.fleet.layers.mpu.random")
    hybrid = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")

    where = "fleet.recompute.recompute_hybrid"
    fn_cls = patcher.require(hybrid, "_HPRecomputeFunction", where)
    stock_forward = patcher.require(fn_cls, "forward", "_HPRecomputeFunction")
    patcher.check_params(stock_forward, _FORWARD_PARAMS, "_HPRecomputeFunction.forward")
    # What our forward relies on: the stock backward (reads the ctx we fill), the state
    # switch it calls, the tracker whose states we record, and the merge helper.
    patcher.check_params(patcher.require(fn_cls, "backward", "_HPRecomputeFunction"), ["ctx", "args"],
                         "_HPRecomputeFunction.backward")
    patcher.check_params(patcher.require(hybrid, "switch_rng_state_tracker", where),
                         ["rng_state", "tracker", "numpy_state", "random_state", "custom_state",
                          "custom_get_state_func", "custom_set_state_func"], "switch_rng_state_tracker")
    tracker_cls = patcher.require(mp_random, "RNGStatesTracker", "fleet.layers.mpu.random")
    patcher.require(tracker_cls, "get_states_tracker", "RNGStatesTracker")
    patcher.require(tracker_cls, "set_states_tracker", "RNGStatesTracker")
    stock_merge = patcher.require(hybrid, "_merge_activation", where)
    patcher.check_params(stock_merge, ["tensor", "mp_group"], "recompute_hybrid._merge_activation")

    patcher.set(fn_cls, "forward", staticmethod(_make_forward(stock_forward)))
    patcher.set(hybrid, "_merge_activation", _make_merge(stock_merge))
