"""Collectives gloo lacks, at Paddle's Python API: reduce_scatter.

``ProcessGroupGloo`` has no reduce_scatter ("ProcessGroupGLOO does not support
reduce_scatter with sync_op flag"), which sequence parallelism
(``sequence_parallel_utils.reduce_scatter``, ``SPInnerOverlapLinear``) and sharding use.
Patch: ``paddle.distributed.communication.stream.reduce_scatter``'s two dygraph
implementations (tensor form and list form), on gloo groups only:

* a sum (and an average: the sum divided by the group's size) runs the ``reduce_scatter`` op on
  the group, whose CPU kernel is the plugin's ring over gloo (:mod:`.kernels`): each byte is
  reduced once, each rank sends (n - 1) / n of its input;
* a max, min or product, which that kernel does not do, and any reduction where the kernel could
  not be put in place (:func:`.kernels.apply` says so), reduces a copy of the whole input with
  ``all_reduce`` and keeps this rank's chunk: ``nranks`` times the data, the same values.

The work completes inside the call; the returned task's ``wait()`` returns at once.  On any other
group (NCCL, BKCL, ...) both call Paddle's original unchanged.  :func:`.kernels.apply` installs
this, once it knows whether the kernel is there.
"""
from __future__ import annotations

import functools

from ..registry.device import is_gloo

__all__ = ["apply_reduce_scatter", "reduce_scatter_on_gloo", "DoneTask"]


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


def _check_rows(out_tensor, in_tensor, nranks: int) -> None:
    if in_tensor.shape[0] != out_tensor.shape[0] * nranks:
        raise ValueError(f"paddle_hybrid.gloo: reduce_scatter input has {in_tensor.shape[0]} rows, expected "
                         f"{nranks} x the output's {out_tensor.shape[0]}.")


def reduce_scatter_on_gloo(out_tensor, in_tensor, op, group, use_kernel: bool) -> None:
    """``out_tensor`` (in place) = this rank's dim-0 chunk of ``in_tensor`` reduced over ``group``:
    through the ``reduce_scatter`` kernel for a sum or an average when ``use_kernel``, else by
    ``all_reduce`` and a slice."""
    import paddle
    import paddle.distributed as dist

    nranks, rank = group.nranks, group.rank
    _check_rows(out_tensor, in_tensor, nranks)
    from .fake_world import is_fake  # (fake_world builds on this module's DoneTask)

    if is_fake(group.process_group):  # a dry run's group: no comm context for the C++ kernel
        _fake_reduce_scatter(out_tensor, in_tensor, op, group, use_kernel)
        return
    with paddle.no_grad():
        if use_kernel and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            chunk = paddle._C_ops.reduce_scatter(in_tensor, group.id, nranks)
            if op == dist.ReduceOp.AVG:
                chunk = chunk / nranks
            paddle.assign(chunk, output=out_tensor)
            return
        reduced = in_tensor.clone()
        dist.all_reduce(reduced, op=op, group=group)
        rows = out_tensor.shape[0]
        paddle.assign(reduced[rank * rows:(rank + 1) * rows], output=out_tensor)


def _fake_reduce_scatter(out_tensor, in_tensor, op, group, use_kernel: bool) -> None:
    """The fake world's answer (the process group's: this rank's slot of its input), with the memory the
    real path below holds meanwhile, so a dry run's peak is the real run's: the kernel's output chunk
    and its ring buffers (``received``, and ``partial`` from 3 ranks on: ``custom_ops/gloo_kernels.cc``),
    or the all_reduce path's whole copy of the input."""
    import paddle
    import paddle.distributed as dist

    nranks = group.nranks
    with paddle.no_grad():
        if use_kernel and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            held = [paddle.empty_like(out_tensor) for _ in range(1 + (nranks > 1) + (nranks > 2))]
            group.process_group.reduce_scatter(held[0], in_tensor, op, True)
            chunk = held[0]
            del held[1:]
            if op == dist.ReduceOp.AVG:  # the division's new tensor; the value stays (every rank alike)
                chunk = chunk.clone()
            paddle.assign(chunk, output=out_tensor)
            return
        reduced = in_tensor.clone()
        group.process_group.reduce_scatter(out_tensor, reduced, op, True)
        del reduced


def _make_tensor_form(orig, use_kernel: bool):
    @functools.wraps(orig)
    def _reduce_scatter_tensor_in_dygraph(out_tensor, in_tensor, op, group, sync_op, use_calc_stream,
                                          caller="reduce_scatter"):
        if not is_gloo(group):
            return orig(out_tensor, in_tensor, op, group, sync_op, use_calc_stream, caller)
        reduce_scatter_on_gloo(out_tensor, in_tensor, op, group, use_kernel)
        return DoneTask()

    return _reduce_scatter_tensor_in_dygraph


def _make_list_form(orig, use_kernel: bool):
    @functools.wraps(orig)
    def _reduce_scatter_in_dygraph(tensor, tensor_list, op, group, sync_op, use_calc_stream):
        import paddle

        if not is_gloo(group):
            return orig(tensor, tensor_list, op, group, sync_op, use_calc_stream)
        reduce_scatter_on_gloo(tensor, paddle.concat(list(tensor_list), axis=0), op, group, use_kernel)
        return DoneTask()

    return _reduce_scatter_in_dygraph


def apply_reduce_scatter(patcher, use_kernel: bool) -> None:
    """Both dygraph implementations of ``stream.reduce_scatter`` on gloo groups (``use_kernel``:
    the plugin's reduce_scatter kernel is in place)."""
    import importlib

    # The package re-exports a function of the same name; the module is what we patch.
    rs = importlib.import_module("paddle.distributed.communication.stream.reduce_scatter")

    patcher.check_params(rs._reduce_scatter_tensor_in_dygraph,
                         ["out_tensor", "in_tensor", "op", "group", "sync_op", "use_calc_stream", "caller"],
                         "stream.reduce_scatter._reduce_scatter_tensor_in_dygraph")
    patcher.check_params(rs._reduce_scatter_in_dygraph,
                         ["tensor", "tensor_list", "op", "group", "sync_op", "use_calc_stream"],
                         "stream.reduce_scatter._reduce_scatter_in_dygraph")
    patcher.set(rs, "_reduce_scatter_tensor_in_dygraph",
                _make_tensor_form(rs._reduce_scatter_tensor_in_dygraph, use_kernel))
    patcher.set(rs, "_reduce_scatter_in_dygraph", _make_list_form(rs._reduce_scatter_in_dygraph, use_kernel))
