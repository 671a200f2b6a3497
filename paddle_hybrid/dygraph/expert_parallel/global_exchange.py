"""``global_scatter`` / ``global_gather`` (``paddle.distributed.utils.moe_utils``) on gloo.

They move tokens between the ranks of a MoE group: rank ``r`` holds ``E`` experts, and
``local_count[j * E + i]`` counts the rows this rank sends to expert ``i`` of rank ``j``,
``global_count[j * E + i]`` the rows it receives from rank ``j`` for its own expert ``i``.
Both ops have no CPU kernel ("Do not support global scatter op for cpu kernel now").  Layouts,
as Paddle's NCCL kernels arrange them:

* ``global_scatter``: the input is ordered by destination rank, then expert (the order of
  ``local_count``); the output by local expert, then source rank, so each expert's rows are
  contiguous (``MoELayer`` slices them by expert).
* ``global_gather``: the inverse; its input is ordered like the scatter's output and its output
  like the scatter's input.

On gloo each is one all-to-all of rank-sized blocks (:mod:`.all_to_all`, every row crosses
the wire once) plus one local reordering of the blocks between rank-major and expert-major.
Each is differentiable, the gradient of one being the other with the same counts (Paddle
registers the same pair of gradients for its ops).

The token counts themselves are exchanged by ``count_by_gate``
(``paddle.incubate.distributed.models.moe.utils``) through its ``_alltoall``, which calls the
process group's legacy ``alltoall`` with its *output* first, although that method takes its input
first (``alltoall(in, out)``, as its pybind signature and C++ say; Paddle 3.3's NCCL group no
longer implements it at all: "does not support AllToAll").  Passed through faithfully, the counts
are overwritten by an uninitialised buffer.  So on a gloo group ``_alltoall`` is replaced by the
same exchange in the right order (``all_to_all_tensor(out, in)``); any other group keeps Paddle's.  The device rule per call: a static program,
a group that is not gloo or a tensor that is not on the CPU goes to Paddle's original.
"""
from __future__ import annotations

import functools

import numpy as np

from ...registry.device import is_gloo, on_cpu

__all__ = ["apply", "global_scatter_gloo", "global_gather_gloo"]


def _counts(local_count, global_count, nranks):
    lc = local_count.numpy().reshape(-1).astype(np.int64)
    gc = global_count.numpy().reshape(-1).astype(np.int64)
    if lc.size != gc.size or lc.size % nranks:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: local_count ({lc.size}) and global_count "
                         f"({gc.size}) must both have n_expert x {nranks} (group size) entries.")
    return lc.reshape(nranks, -1), gc.reshape(nranks, -1)


def _block_rows(block_sizes, order):
    """Row indices that read blocks of ``block_sizes`` ([rank, expert] laid out rank-major) in
    ``order`` ("expert" or "rank" major)."""
    starts = (np.cumsum(block_sizes.reshape(-1)) - block_sizes.reshape(-1)).reshape(block_sizes.shape)
    ranks, experts = block_sizes.shape
    pairs = ([(j, i) for i in range(experts) for j in range(ranks)] if order == "expert"
             else [(j, i) for j in range(ranks) for i in range(experts)])
    pieces = [np.arange(starts[j, i], starts[j, i] + block_sizes[j, i]) for j, i in pairs]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros([0], np.int64)


def _expert_major_to_rank_major(block_sizes):
    """Row indices that turn an expert-major buffer of ``block_sizes`` into rank-major."""
    expert_major = _block_rows(block_sizes, "expert")  # rank-major row of each expert-major row
    inverse = np.empty_like(expert_major)
    inverse[expert_major] = np.arange(expert_major.size)
    return inverse


def _reorder(x, rows):
    import paddle

    if rows.size == 0:
        return x[0:0]
    return paddle.index_select(x, paddle.to_tensor(rows, place=paddle.CPUPlace()), axis=0)


def _exchange(pg, x, send_rows, recv_rows):
    import paddle

    out = paddle.empty([int(recv_rows.sum())] + list(x.shape[1:]), dtype=x.dtype)
    # The group's own method (gloo's: paddle_hybrid.gloo.all_to_all), so the dry run's fake group answers it
    # and its probe logs it, as it does the counts' exchange.
    pg.all_to_all_single(out, x.contiguous(), recv_rows.tolist(), send_rows.tolist(), True).wait()
    return out


def _scatter_values(x, lc, gc, pg):
    received = _exchange(pg, x, lc.sum(axis=1), gc.sum(axis=1))  # rank-major: blocks gc[j, i]
    return _reorder(received, _block_rows(gc, "expert"))


def _gather_values(x, lc, gc, pg):
    rank_major = _reorder(x, _expert_major_to_rank_major(gc))
    return _exchange(pg, rank_major, gc.sum(axis=1), lc.sum(axis=1))  # rank-major: blocks lc[j, i]


def _autograd_pair():
    from paddle.autograd import PyLayer

    class GlobalScatter(PyLayer):
        @staticmethod
        def forward(ctx, x, lc, gc, pg):
            ctx.args = (lc, gc, pg)
            return _scatter_values(x, lc, gc, pg)

        @staticmethod
        def backward(ctx, grad):
            lc, gc, pg = ctx.args
            return _gather_values(grad, lc, gc, pg)

    class GlobalGather(PyLayer):
        @staticmethod
        def forward(ctx, x, lc, gc, pg):
            ctx.args = (lc, gc, pg)
            return _gather_values(x, lc, gc, pg)

        @staticmethod
        def backward(ctx, grad):
            lc, gc, pg = ctx.args
            return _scatter_values(grad, lc, gc, pg)

    return GlobalScatter, GlobalGather


_PAIR = []


def _layers():
    if not _PAIR:
        _PAIR.extend(_autograd_pair())
    return _PAIR


def _takes_cpu_path(x, local_count, global_count, group) -> bool:
    import paddle

    return (paddle.in_dynamic_mode() and is_gloo(group)
            and all(on_cpu(t) for t in (x, local_count, global_count)))


def _resolve_group(group):
    import paddle.distributed as dist

    return dist.collective._get_global_group() if group is None else group


def global_scatter_gloo(x, local_count, global_count, group=None):
    """``global_scatter`` on a gloo group, differentiable."""
    group = _resolve_group(group)
    lc, gc = _counts(local_count, global_count, group.nranks)
    if x.shape[0] != lc.sum():
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: global_scatter: x has {x.shape[0]} rows, "
                         f"local_count sends {int(lc.sum())}.")
    return _layers()[0].apply(x, lc, gc, group.process_group)


def global_gather_gloo(x, local_count, global_count, group=None):
    """``global_gather`` on a gloo group, differentiable."""
    group = _resolve_group(group)
    lc, gc = _counts(local_count, global_count, group.nranks)
    if x.shape[0] != gc.sum():
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: global_gather: x has {x.shape[0]} rows, "
                         f"global_count sends {int(gc.sum())}.")
    return _layers()[1].apply(x, lc, gc, group.process_group)


def _make(original, gloo_version):
    @functools.wraps(original)
    def wrapper(x, local_count, global_count, group=None, use_calc_stream=True):
        if group is not None and not group.is_member():
            return None  # as Paddle's
        if not _takes_cpu_path(x, local_count, global_count, group):
            return original(x, local_count, global_count, group, use_calc_stream)
        return gloo_version(x, local_count, global_count, group)

    return wrapper


def _make_count_alltoall(original):
    @functools.wraps(original)
    def _alltoall(in_tensor_list, group=None, use_calc_stream=True):
        import paddle

        if group is not None and not group.is_member():
            return None  # as Paddle's
        if not (paddle.in_dynamic_mode() and is_gloo(group) and on_cpu(in_tensor_list)):
            return original(in_tensor_list, group, use_calc_stream)
        group = _resolve_group(group)
        out = paddle.empty(in_tensor_list.shape, in_tensor_list.dtype)
        group.process_group.all_to_all_tensor(out, in_tensor_list, True).wait()
        return out

    return _alltoall


def apply(config, patcher) -> None:
    import importlib

    incubate_utils = importlib.import_module("paddle.incubate.distributed.models.moe.utils")
    count_alltoall = patcher.require(incubate_utils, "_alltoall", "paddle.incubate.distributed.models.moe.utils")
    patcher.check_params(count_alltoall, ["in_tensor_list", "group", "use_calc_stream"], "moe.utils._alltoall")
    patcher.set(incubate_utils, "_alltoall", _make_count_alltoall(count_alltoall))

    moe_utils = importlib.import_module("paddle.distributed.utils.moe_utils")
    moe_layer = importlib.import_module("paddle.incubate.distributed.models.moe.moe_layer")
    params = ["x", "local_count", "global_count", "group", "use_calc_stream"]
    for name, gloo_version in (("global_scatter", global_scatter_gloo), ("global_gather", global_gather_gloo)):
        original = patcher.require(moe_utils, name, "paddle.distributed.utils.moe_utils")
        patcher.check_params(original, params, f"moe_utils.{name}")
        replacement = _make(original, gloo_version)
        patcher.set(moe_utils, name, replacement)
        # moe_layer imported it by name.
        if patcher.require(moe_layer, name, "moe_layer") is original:
            patcher.set(moe_layer, name, replacement)
