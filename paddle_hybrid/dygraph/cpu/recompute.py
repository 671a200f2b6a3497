"""Recompute on CPU with the random state of the forward replayed in the recompute.

A dropout inside a recomputed block must draw in the recompute the mask it drew in
the forward, else the gradient belongs to another network.  Fleet keeps that promise
by saving Paddle's generator state, the model-parallel ``RNGStatesTracker``'s states,
NumPy's and Python's before the forward and switching to them for the recompute
(``recompute.switch_rng_state_tracker``).  On a CPU build that machinery itself works
(the CPU generator's state and the tracker's state indices can be read and set back:
checked by the tests); what stops is a device gate, an in-place flatten and two ``.cuda()``
calls:

1. ``recompute_hybrid._HPRecomputeFunction.forward``: fleet's hybrid (model-parallel
   aware) recompute, reached through ``recompute_hybrid`` and through every
   ``PipelineLayer(recompute_interval > 0)``, fails on its first call with
   ``AssertionError: Recompute with RNG is not support current device: cpu.``  The gate
   asks whether the current device is a GPU, an XPU or one of
   ``paddle.device.get_all_custom_device_type()``; the rest of the forward holds on CPU.
   Patch: a device answer (``Patcher.answer``): on a CPU run
   (``paddle_hybrid.registry.device.running_on_cpu``, the device the gate asks about) the
   ``paddle`` that ``recompute_hybrid`` reads answers ``device.get_all_custom_device_type()``
   with ``"cpu"`` listed too; the gate is that module's only caller of it.  The block it
   recomputes and every other module read the real ``paddle``; nothing is changed globally.
   ``offload=True`` is passed on as False on CPU: the activations already are in host
   memory, and the stock backward would move them back with ``.cuda()`` (``ValueError: No
   available device found.``).  Other devices get Paddle's forward with the caller's
   arguments.
2. ``recompute_hybrid._split_activation`` (``partition=True``, an mp group of 2 or more
   ranks): the stock split flattens the caller's activation in place (``flatten_`` on a
   ``detach()`` sharing it), which reshapes it and bumps its inplace version, so a backward
   node that saved it failed ("Tensor '' used in gradient computation has been modified by
   an inplace operation", seen with a tanh in front of the block).  Patch: for a tensor in
   host memory, this rank's part of a flattened view, the caller's tensor untouched (the
   stock forward clones the part); other tensors take the stock split.
3. ``recompute_hybrid._merge_activation``: with ``partition=True`` the backward
   all-gathers the activation from ``tensor.cuda()``, which fails the same way on CPU.
   Patch: a tensor in host memory on a gloo mp group is gathered where it is (gloo gathers
   host memory); any other tensor or group (an offloaded activation on NCCL, say) takes
   the stock path.

Checked and left alone: plain ``fleet.utils.recompute`` (both the re-entrant
``RecomputeFunction`` and ``use_reentrant=False``) saves and restores
``paddle.get_rng_state()`` of the current place, which on CPU is the CPU generator, so
dropout masks already match there.
"""
from __future__ import annotations

import functools
import importlib

from ...registry.device import custom_device_types_with_cpu, is_gloo, on_cpu, running_on_cpu

__all__ = ["apply"]

_FORWARD_PARAMS = ["ctx", "run_function", "all_outputs", "mp_group", "offload", "partition",
                   "custom_get_state_func", "custom_set_state_func", "args", "kwargs"]
# A constant of the stock forward's code: the gate this concern answers for the CPU.
_GATE_MESSAGE = "Recompute with RNG is not support current device"


def _asks_the_device_gate(fn) -> bool:
    """``fn`` is Paddle's forward with the gate: its own code holds the gate's message and reads
    ``paddle`` from its module (a wrapper around it would not, and could not be answered)."""
    code = getattr(fn, "__code__", None)
    if code is None or "paddle" not in code.co_names or "paddle" not in getattr(fn, "__globals__", {}):
        return False
    return any(isinstance(const, str) and _GATE_MESSAGE in const for const in code.co_consts)


def _make_forward(stock_forward):
    @functools.wraps(stock_forward)
    def forward(ctx, run_function, all_outputs, mp_group, offload, partition,
                custom_get_state_func, custom_set_state_func, *args, **kwargs):
        if not running_on_cpu():
            return stock_forward(ctx, run_function, all_outputs, mp_group, offload, partition,
                                 custom_get_state_func, custom_set_state_func, *args, **kwargs)
        # offload=False: host memory already; see the module docstring.
        return stock_forward(ctx, run_function, all_outputs, mp_group, False, partition,
                             custom_get_state_func, custom_set_state_func, *args, **kwargs)

    return forward


def _own_part(tensor, mp_group):
    """This rank's 1/n of the flattened activation, a view (what the stock backward's
    ``_merge_activation`` gathers back); the caller's tensor keeps its shape and version."""
    n = mp_group.nranks
    numel = int(tensor.numel())
    if numel == 0 or numel % n:
        raise ValueError(f"paddle_hybrid.dygraph.cpu: recompute partition needs an activation whose size "
                         f"({numel}) is a nonzero multiple of the mp degree ({n}).")
    part = numel // n
    start = part * mp_group.rank
    return tensor.reshape([-1])[start:start + part]


def _make_split(stock_split):
    @functools.wraps(stock_split)
    def _split_activation(tensor, mp_group):
        if mp_group.nranks < 2 or not on_cpu(tensor):
            return stock_split(tensor, mp_group)
        return _own_part(tensor, mp_group)

    return _split_activation


def _make_merge(stock_merge):
    @functools.wraps(stock_merge)
    def _merge_activation(tensor, mp_group):
        if mp_group.nranks < 2 or not (on_cpu(tensor) and is_gloo(mp_group)):
            return stock_merge(tensor, mp_group)
        import paddle

        shape = list(tensor.shape)
        shape[0] *= mp_group.nranks
        out = paddle.empty(shape, tensor.dtype)
        mp_group.process_group.all_gather(tensor, out).wait()
        return out

    return _merge_activation


def apply(config, patcher) -> None:
    from ...registry.patching import PatchSignatureError

    hybrid = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")
    where = "fleet.recompute.recompute_hybrid"
    fn_cls = patcher.require(hybrid, "_HPRecomputeFunction", where)
    stock_forward = patcher.require(fn_cls, "forward", "_HPRecomputeFunction")
    patcher.check_params(stock_forward, _FORWARD_PARAMS, "_HPRecomputeFunction.forward")
    if not _asks_the_device_gate(stock_forward):
        raise PatchSignatureError(
            f"paddle_hybrid.dygraph.cpu: _HPRecomputeFunction.forward does not hold the device gate "
            f"{_GATE_MESSAGE!r} this patch answers for the CPU (or is wrapped by something else); "
            f"unexpected Paddle. Set {patcher.off_switch} to run without the CPU/gloo patches.")
    # The stock backward reads the ctx the stock forward fills; recorded offload=False makes it
    # skip its .cuda(), partition makes it call the merge below.
    patcher.check_params(patcher.require(fn_cls, "backward", "_HPRecomputeFunction"), ["ctx", "args"],
                         "_HPRecomputeFunction.backward")
    stock_split = patcher.require(hybrid, "_split_activation", where)
    patcher.check_params(stock_split, ["tensor", "mp_group"], "recompute_hybrid._split_activation")
    stock_merge = patcher.require(hybrid, "_merge_activation", where)
    patcher.check_params(stock_merge, ["tensor", "mp_group"], "recompute_hybrid._merge_activation")

    patcher.answer(hybrid, "paddle", {"device.get_all_custom_device_type":
                                      custom_device_types_with_cpu},
                   when=running_on_cpu, why="the recompute forward's device gate on a CPU run")
    patcher.set(fn_cls, "forward", staticmethod(_make_forward(stock_forward)))
    patcher.set(hybrid, "_split_activation", _make_split(stock_split))
    patcher.set(hybrid, "_merge_activation", _make_merge(stock_merge))
