"""Collectives gloo lacks: reduce_scatter.

``ProcessGroupGloo`` has no reduce_scatter ("ProcessGroupGLOO does not support
reduce_scatter with sync_op flag"), which sequence parallelism
(``sequence_parallel_utils.reduce_scatter``, ``SPInnerOverlapLinear``) and sharding use.
Patch: ``paddle.distributed.communication.stream.reduce_scatter``'s two dygraph
implementations (tensor form and list form), on gloo groups only, reduce a copy of the
whole input with ``all_reduce`` and copy this rank's chunk into the output.  That moves
``nranks`` times the data of a real reduce_scatter, but the values are the same: the
chunk of rank ``r`` is the reduction of every rank's chunk ``r``.  The work completes
inside the call; the returned task's ``wait()`` returns at once.  On any other group (NCCL,
BKCL, ...) both call Paddle's original unchanged.
"""
from __future__ import annotations

import functools

from ..registry.device import is_gloo

__all__ = ["apply", "reduce_scatter_by_all_reduce", "DoneTask"]


class DoneTask:
    """What an emulation that completes inside its call returns where Paddle returns a task
    (also :mod:`paddle_hybrid.dygraph.expert_parallel`'s all-to-all)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def is_sync(self):
        return True

    def synchronize(self):
        return None


def reduce_scatter_by_all_reduce(out_tensor, in_tensor, op, group) -> None:
    """``out_tensor`` (in place) = this rank's dim-0 chunk of ``in_tensor`` reduced over ``group``."""
    import paddle
    import paddle.distributed as dist

    nranks, rank = group.nranks, group.rank
    if in_tensor.shape[0] != out_tensor.shape[0] * nranks:
        raise ValueError(f"paddle_hybrid.dygraph.cpu: reduce_scatter input has {in_tensor.shape[0]} rows, expected "
                         f"{nranks} x the output's {out_tensor.shape[0]}.")
    with paddle.no_grad():
        reduced = in_tensor.clone()
        dist.all_reduce(reduced, op=op, group=group)
        rows = out_tensor.shape[0]
        paddle.assign(reduced[rank * rows:(rank + 1) * rows], output=out_tensor)


def _make_tensor_form(orig):
    @functools.wraps(orig)
    def _reduce_scatter_tensor_in_dygraph(out_tensor, in_tensor, op, group, sync_op, use_calc_stream,
                                          caller="reduce_scatter"):
        if not is_gloo(group):
            return orig(out_tensor, in_tensor, op, group, sync_op, use_calc_stream, caller)
        reduce_scatter_by_all_reduce(out_tensor, in_tensor, op, group)
        return DoneTask()

    return _reduce_scatter_tensor_in_dygraph


def _make_list_form(orig):
    @functools.wraps(orig)
    def _reduce_scatter_in_dygraph(tensor, tensor_list, op, group, sync_op, use_calc_stream):
        import paddle

        if not is_gloo(group):
            return orig(tensor, tensor_list, op, group, sync_op, use_calc_stream)
        reduce_scatter_by_all_reduce(tensor, paddle.concat(list(tensor_list), axis=0), op, group)
        return DoneTask()

    return _reduce_scatter_in_dygraph


def apply(config, patcher) -> None:
    import importlib

    # The package re-exports a function of the same name; the module is what we patch.
    rs = importlib.import_module("paddle.distributed.communication.stream.reduce_scatter")

    patcher.check_params(rs._reduce_scatter_tensor_in_dygraph,
                         ["out_tensor", "in_tensor", "op", "group", "sync_op", "use_calc_stream", "caller"],
                         "stream.reduce_scatter._reduce_scatter_tensor_in_dygraph")
    patcher.check_params(rs._reduce_scatter_in_dygraph,
                         ["tensor", "tensor_list", "op", "group", "sync_op", "use_calc_stream"],
                         "stream.reduce_scatter._reduce_scatter_in_dygraph")
    patcher.set(rs, "_reduce_scatter_tensor_in_dygraph", _make_tensor_form(rs._reduce_scatter_tensor_in_dygraph))
    patcher.set(rs, "_reduce_scatter_in_dygraph", _make_list_form(rs._reduce_scatter_in_dygraph))
