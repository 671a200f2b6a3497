"""Sharding stage 1 on gloo with one collective per owning rank, not one per parameter
(component ``sharding_fused_comm``).

Fleet's ``DygraphShardingOptimizer`` (stage 1, V1: what PaddleFormers' Trainer builds for its
default ``--sharding stage1``, so also for a plain data-parallel Trainer run) sends every gradient
to the rank that owns its parameter with one ``reduce`` a parameter (``reduce_gradients``), and
after the step every updated parameter back with one ``broadcast`` a parameter
(``_sharding_sync_parameters``).  On gloo each call costs a round trip whatever its size, so a
small model pays for two collectives a parameter a step: the example's tiny LLaMA on the Trainer
in DP2 spent 44 of its 73 ms a step in them (``docs/benchmarks.md``).  Paddle's own remedy,
``tensor_fusion``, does not reach this path from the Trainer without ``split_param``, and its
comm-overlap buffers are for accelerators.

What this does, on a sharding group backed by gloo: the gradients (after the scale Paddle applies
before its sum) are concatenated per owning rank and dtype into one flat tensor, reduced to the
owner in one call and copied back into the owner's gradients in place; after the step, the
parameters each rank owns are concatenated the same way, broadcast from it in one call, and
copied into the others' parameters in place.  A rank that does not own a gradient keeps its local
value, where Paddle's reduce leaves gloo's scratch: nothing reads it (the step updates and clips
the owned parameters only, then the gradients are cleared).

Bitwise the same as Paddle's calls on 2 ranks (one sum, one copy); on more, gloo may add the ranks'
parts of one element in another order in a longer buffer (a few ulp, tested against one process).
On by default on a build with no accelerator (``PADDLE_HYBRID_SHARDING_FUSED_COMM=auto|on|off``);
installed anywhere, Paddle's code still runs unchanged where this does not apply: a group on
another backend (the device rule: this ran on gloo only), ``comm_overlap`` / ``tensor_fusion`` / broadcast overlap (their own
buffers), ``FLAGS_pp_check_naninf`` (Paddle checks each gradient), XPU's cluster-parallel sync.
"""
from __future__ import annotations

import collections
import os

from ...common.tensor_bytes import concat_flat, copy_into, paddle_checks_each_tensor
from ...registry import device
from ...registry.component import Component

__all__ = ["COMPONENT", "apply", "calls"]

_CALLS = collections.Counter()  # collectives this process made through the fused path, by kind


def calls(kind: str) -> int:
    """How many fused ``"reduce"`` or ``"broadcast"`` calls this process made."""
    return _CALLS[kind]


# ---------------------------------------------------------------------------
# the fused collectives
# ---------------------------------------------------------------------------

def _by_owner_and_dtype(items):
    """``{(owner, dtype): [tensor, ...]}`` in first-seen order, from ``(owner, tensor)`` pairs."""
    groups = {}
    for owner, tensor in items:
        groups.setdefault((owner, tensor.dtype), []).append(tensor)
    return groups


def _reduce_fused(tensors, dst: int, op, group, mine: bool) -> None:
    import paddle.distributed as dist

    flat = concat_flat(tensors)
    dist.reduce(flat, dst=dst, op=op, group=group, sync_op=True)
    _CALLS["reduce"] += 1
    if mine:
        copy_into(flat, tensors)


def _broadcast_fused(tensors, src: int, group, mine: bool) -> None:
    import paddle.distributed as dist

    flat = concat_flat(tensors)
    dist.broadcast(flat, src=src, group=group, sync_op=True)
    _CALLS["broadcast"] += 1
    if not mine:
        copy_into(flat, tensors)


# ---------------------------------------------------------------------------
# the two methods of DygraphShardingOptimizer
# ---------------------------------------------------------------------------

def _paddle_path_only(optimizer, group) -> bool:
    """Where Paddle's own code must run (see the module docstring)."""
    return (not device.is_gloo(group) or optimizer.comm_overlap or optimizer.tensor_fusion
            or getattr(optimizer, "_broadcast_overlap", False)
            or paddle_checks_each_tensor()
            or (device.xpu_build() and os.getenv("XPU_CDNN_CLUSTER_PARALLEL") is not None))


def _reduce_op(optimizer):
    """Paddle's choice: AVG where the backend has it, else each gradient is scaled by 1 / nranks
    and summed (also in align mode, which scales in advance).  Returns ``(op, scale first)``."""
    import paddle
    from paddle.distributed import ReduceOp

    if not optimizer.use_reduce_avg:
        return ReduceOp.SUM, True
    return (ReduceOp.SUM if paddle.distributed.in_auto_parallel_align_mode() else ReduceOp.AVG), False


def _gradient_to_reduce(optimizer, param, nranks: int, scale: bool):
    """Phases as Paddle's loop: a missing gradient becomes zeros (kept on the parameter); the
    gradient is scaled by 1 / nranks where the op is a plain sum."""
    import paddle

    grad = optimizer._get_param_grad(param)
    if grad is None:
        if hasattr(param, "main_grad"):
            grad = paddle.zeros_like(param, dtype=paddle.float32)
            param.main_grad = grad
        else:
            grad = paddle.zeros_like(param, dtype=param.dtype)
            param.grad = grad
    if scale:
        grad.scale_(1.0 / nranks)
    return grad


def _make_reduce_gradients(original):
    def reduce_gradients(self, parameter_list, hcg):
        group = hcg.get_sharding_parallel_group()
        if _paddle_path_only(self, group):
            return original(self, parameter_list, hcg)
        from paddle import framework

        op, scale = _reduce_op(self)
        with framework.no_grad():
            owned = [(self._param2rank[param.name], _gradient_to_reduce(self, param, group.nranks, scale))
                     for param in parameter_list]
            for (owner, _dtype), grads in _by_owner_and_dtype(owned).items():
                _reduce_fused(grads, group.ranks[owner], op, group, owner == self._sharding_rank)
        return None

    return reduce_gradients


def _make_sync_parameters(original):
    def _sharding_sync_parameters(self):
        group = self._hcg.get_sharding_parallel_group()
        if _paddle_path_only(self, group):
            return original(self)
        from paddle import framework

        with framework.no_grad():
            # Paddle sends a parameter only if it has a gradient (a frozen one was not updated)
            sent = [(rank, param) for rank, params in self._rank2params.items() for param in params
                    if self._get_param_grad(param) is not None]
            for (owner, _dtype), params in _by_owner_and_dtype(sent).items():
                _broadcast_fused(params, group.ranks[owner], group, owner == self._sharding_rank)
        return None

    return _sharding_sync_parameters


def apply(config, patcher) -> str:
    """Phase: replace the two methods on ``DygraphShardingOptimizer`` (V1) through ``patcher``."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import dygraph_sharding_optimizer as module

    where = "paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.DygraphShardingOptimizer"
    cls = patcher.require(module, "DygraphShardingOptimizer", where.rsplit(".", 1)[0])
    patcher.set(cls, "reduce_gradients", _make_reduce_gradients(patcher.require(cls, "reduce_gradients", where)))
    patcher.set(cls, "_sharding_sync_parameters",
                _make_sync_parameters(patcher.require(cls, "_sharding_sync_parameters", where)))
    return "stage-1 sharding on gloo: one reduce and one broadcast per owning rank"


COMPONENT = Component("sharding_fused_comm", ("3.2.", "3.3."), "sharding_fused_comm", apply)
