"""DeepEP's token dispatch and combine on a gloo group: the contract of PaddleFormers'
``fused_a2a.fused_dispatch`` / ``fused_combine`` (``deep_ep.Buffer.dispatch`` / ``combine``), written
over the plugin's all-to-all.

**What the caller gives and gets** (PaddleFormers 1.2's ``token_dispatcher._DeepepManager``, the Flex
token dispatcher of DeepSeek-V3, GLM4-MoE's Flex layer and the modular MoE layer's "deepep" path):

* :func:`dispatch` ``(x [N, H], topk_idx [N, K] int64 global expert ids, -1 for none, topk_weights
  [N, K] float32, num_experts, group)`` returns ``(recv_x [R, H], recv_topk_weights [R, K], states)``
  with ``states = {"handle", "dispatched_indices", "tokens_per_expert"}``.  Each token goes **once**
  to each rank that owns at least one of its experts (rank ``r`` owns experts ``r * L .. r * L + L - 1``,
  ``L = num_experts / group size``); the received rows are ordered by source rank, then by the
  token's row on its source (DeepEP's order).  ``dispatched_indices`` ``[R, K]`` int64 holds, per
  received token, the receiver's *local* expert id at each top-k position that is the receiver's, and
  -1 elsewhere; ``recv_topk_weights`` the weight there and 0 elsewhere; ``tokens_per_expert`` is a
  Python list of ``L`` ints, the received tokens that chose each local expert.
* :func:`combine` ``(y [R, H], group, handle)`` returns ``[N, H]``: every row of ``y`` goes back to
  the rank and row its token came from, and a token's rows from all ranks are summed (the caller has
  already weighted and summed each rank's experts per token).

**Gradients.**  Each one's backward is the other's forward, as DeepEP's: the gradient of ``recv_x``
is combined back (summed per token over the receiving ranks), the gradient of the combined output is
dispatched to the ranks that received the token; the gradient of ``recv_topk_weights`` goes back to
the top-k position it came from, only the receiver's own positions (elsewhere the weight is the
constant 0), summed into ``topk_weights``' gradient.  Both are ``PyLayer``s, so they compose with
recompute and with any expert computation between them.

**How.**  The layout (who gets which token, the local ids) is worked out on the host from
``topk_idx``; then a count exchange (one int64 per rank pair), one exchange of the token rows, one of
the local ids and one of the weights, each an ``all_to_all_single`` with split sizes on the group's
process group (:mod:`paddle_hybrid.gloo.all_to_all`: every byte sent once, sender to receiver); the
combine and its backward are one exchange each, the dispatch's backward two (the rows' gradient and
the weights'), which every rank runs whether or not its own inputs need them, so no rank waits on
another.  The handle keeps the layout for the combine and the backwards.  Deterministic: a token's
rows are summed in ascending source-rank order.

Not covered: DeepEP's FP8 input (``x`` a tuple of the values and their scales), its events and
asynchronous options (gloo completes inside the call; ``previous_event`` is accepted and ignored),
its low-latency mode, and any group that is not gloo or tensor that is not on the CPU
(:class:`DeepEPAbsentError`: DeepEP's own kernels are what those need).
"""
from __future__ import annotations

import numpy as np

from ..registry.device import is_gloo, on_cpu

__all__ = ["DeepEPAbsentError", "FlexHandle", "dispatch", "combine", "serves", "layout"]

WHERE = "(paddle_hybrid.common.deepep_gloo)"


class DeepEPAbsentError(ImportError):
    """A DeepEP dispatch asked for where neither DeepEP nor the gloo version can serve it."""


class FlexHandle:
    """What a dispatch leaves for its combine and for both backwards (the layout, on the host).

    ``send_rows``: the rows of the dispatched ``x`` in the order they were sent (rank by rank);
    ``send_counts`` / ``recv_counts``: rows sent to / received from each rank; ``recv_local``:
    ``[R, K]`` bool, the top-k positions of each received token that are this rank's experts;
    ``send_local``: ``[S, K]``, each sent row's local expert ids on its receiver (-1: not its)."""

    __slots__ = ("group", "num_tokens", "topk", "send_rows", "send_counts", "send_local", "recv_counts",
                 "recv_local", "dispatched_indices", "tokens_per_expert")

    def __repr__(self):
        return (f"FlexHandle(tokens={self.num_tokens}, topk={self.topk}, sent={self.send_counts}, "
                f"received={self.recv_counts})")


def serves(group) -> bool:
    """Whether this implementation serves ``group`` (None: the global group): a gloo group."""
    return is_gloo(group)


def _group(group):
    import paddle.distributed as dist

    return dist.collective._get_global_group() if group is None else group


def layout(topk_idx: np.ndarray, num_experts: int, nranks: int):
    """Host-side layout of a dispatch: ``(send_rows, send_counts, send_local_idx)`` where
    ``send_local_idx[s, k]`` is the local expert id on the receiving rank of sent row ``s``, or -1."""
    idx = np.asarray(topk_idx, dtype=np.int64)
    if idx.ndim != 2:
        raise ValueError(f"deepep_gloo: topk_idx must be [tokens, topk], got shape {list(idx.shape)}. {WHERE}")
    if num_experts % nranks:
        raise ValueError(f"deepep_gloo: {num_experts} experts do not divide over {nranks} ranks. {WHERE}")
    if idx.size and (idx.max() >= num_experts or idx.min() < -1):
        raise ValueError(f"deepep_gloo: topk_idx holds {int(idx.min())}..{int(idx.max())}, outside -1.."
                         f"{num_experts - 1}. {WHERE}")
    per_rank = num_experts // nranks
    owner = np.where(idx >= 0, idx // per_rank, -1)
    rows, counts, local = [], [], []
    for r in range(nranks):
        mine = owner == r
        chosen = np.nonzero(mine.any(axis=1))[0]
        rows.append(chosen)
        counts.append(int(chosen.size))
        local.append(np.where(mine[chosen], idx[chosen] - r * per_rank, -1))
    topk = idx.shape[1]
    send_rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros([0], np.int64)
    send_local = np.concatenate(local).astype(np.int64) if local else np.zeros([0, topk], np.int64)
    return send_rows, counts, send_local.reshape(-1, topk)


def _exchange(pg, tensor, send_counts, recv_counts):
    """Rows ``send_counts[p]`` of ``tensor`` to rank ``p``; ``recv_counts[p]`` rows from ``p``."""
    import paddle

    out = paddle.empty([int(sum(recv_counts))] + list(tensor.shape[1:]), dtype=tensor.dtype)
    pg.all_to_all_single(out, tensor.contiguous(), [int(c) for c in recv_counts], [int(c) for c in send_counts],
                         True).wait()
    return out


def _rows(tensor, rows: np.ndarray):
    import paddle

    if rows.size == 0:
        return paddle.zeros([0] + list(tensor.shape[1:]), dtype=tensor.dtype)
    return paddle.index_select(tensor, paddle.to_tensor(rows, place=paddle.CPUPlace()), axis=0)


def _sum_rows_into(rows: np.ndarray, values, num_rows: int):
    """``[num_rows, ...]`` zeros with ``values[i]`` added to row ``rows[i]`` (in order)."""
    import paddle

    out = paddle.zeros([num_rows] + list(values.shape[1:]), dtype=values.dtype)
    if rows.size == 0:
        return out
    return paddle.index_add(out, paddle.to_tensor(rows, place=paddle.CPUPlace()), 0, values)


def _combine_values(y, handle):
    """The combine's arithmetic (also the dispatch's backward of ``x``): back to the origin, summed."""
    back = _exchange(handle.group.process_group, y, handle.recv_counts, handle.send_counts)
    return _sum_rows_into(handle.send_rows, back, handle.num_tokens)


def _dispatch_values(x, handle):
    """The dispatch's arithmetic for rows (also the combine's backward)."""
    return _exchange(handle.group.process_group, _rows(x, handle.send_rows), handle.send_counts,
                     handle.recv_counts)


_LAYERS = {}


def _layers():
    if _LAYERS:
        return _LAYERS["dispatch"], _LAYERS["combine"]
    import paddle
    from paddle.autograd import PyLayer

    class GlooDispatch(PyLayer):
        @staticmethod
        def forward(ctx, x, topk_weights, handle):
            ctx.handle = handle
            ctx.frozen = (x.stop_gradient, topk_weights.stop_gradient)
            recv_x = _dispatch_values(x, handle)
            sent = _rows(topk_weights, handle.send_rows)
            mask = paddle.to_tensor(handle.send_local >= 0, place=paddle.CPUPlace())
            sent = paddle.where(mask, sent, paddle.zeros_like(sent))
            recv_w = _exchange(handle.group.process_group, sent, handle.send_counts, handle.recv_counts)
            ctx.recv_x_shape, ctx.recv_x_dtype = list(recv_x.shape), recv_x.dtype
            return recv_x, recv_w

        @staticmethod
        def backward(ctx, grad_x, grad_w):
            # Every rank runs both exchanges whatever it needs (a rank that skipped one would leave the
            # others waiting); an input that needs no gradient gets None, as PyLayer asks.
            handle = ctx.handle
            rows = int(sum(handle.recv_counts))
            if grad_x is None:
                grad_x = paddle.zeros([rows] + list(ctx.recv_x_shape[1:]), dtype=ctx.recv_x_dtype)
            gx = _combine_values(grad_x, handle)
            if grad_w is None:
                grad_w = paddle.zeros([rows, handle.topk], dtype="float32")
            mask = paddle.to_tensor(handle.recv_local, place=paddle.CPUPlace())
            own = paddle.where(mask, grad_w, paddle.zeros_like(grad_w))
            gw = _combine_values(own, handle)
            x_frozen, w_frozen = ctx.frozen
            return (None if x_frozen else gx), (None if w_frozen else gw)

    class GlooCombine(PyLayer):
        @staticmethod
        def forward(ctx, y, handle):
            ctx.handle = handle
            return _combine_values(y, handle)

        @staticmethod
        def backward(ctx, grad):
            return _dispatch_values(grad, ctx.handle)

    _LAYERS.update(dispatch=GlooDispatch, combine=GlooCombine)
    return GlooDispatch, GlooCombine


def _check(where, group, *tensors):
    import paddle

    if isinstance(tensors[0], tuple):
        raise DeepEPAbsentError(f"{where}: an FP8 input (values, scales) needs DeepEP's kernels; the gloo version "
                                f"dispatches one tensor. {WHERE}")
    if not paddle.in_dynamic_mode() or not serves(group) or not all(on_cpu(t) for t in tensors if t is not None):
        raise DeepEPAbsentError(f"DeepEP is not supported in your paddlepaddle whl package ({where}: the gloo "
                                "version serves a gloo group with CPU tensors in dynamic mode only; this group or "
                                f"tensor needs DeepEP's kernels). {WHERE}")


def dispatch(x, topk_idx, topk_weights, num_experts: int, group=None, previous_event=None):
    """``fused_dispatch``'s contract on gloo: ``(recv_x, recv_topk_weights, states)`` (module doc)."""
    import paddle

    group = _group(group)
    _check("fused_dispatch", group, x, topk_idx, topk_weights)
    if x.ndim != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"deepep_gloo: x {list(x.shape)} must be [tokens, hidden] and topk_idx "
                         f"{list(topk_idx.shape)} [tokens, topk]. {WHERE}")
    if topk_weights is not None and list(topk_weights.shape) != list(topk_idx.shape):
        raise ValueError(f"deepep_gloo: topk_weights {list(topk_weights.shape)} must match topk_idx "
                         f"{list(topk_idx.shape)}. {WHERE}")
    nranks = group.nranks
    send_rows, send_counts, send_local = layout(topk_idx.numpy(), num_experts, nranks)
    pg = group.process_group
    counts = _exchange(pg, paddle.to_tensor(np.asarray(send_counts, np.int64).reshape(nranks, 1)),
                       [1] * nranks, [1] * nranks)
    handle = FlexHandle()
    handle.group = group
    handle.num_tokens = int(x.shape[0])
    handle.topk = int(topk_idx.shape[1])
    handle.send_rows = send_rows
    handle.send_counts = send_counts
    handle.send_local = send_local
    handle.recv_counts = [int(c) for c in counts.numpy().reshape(-1)]
    recv_idx = _exchange(pg, paddle.to_tensor(send_local.reshape(-1, handle.topk)), send_counts,
                         handle.recv_counts)
    local = recv_idx.numpy()
    handle.recv_local = local >= 0
    per_rank = num_experts // nranks
    handle.tokens_per_expert = [int(c) for c in np.bincount(local[local >= 0], minlength=per_rank)]
    handle.dispatched_indices = recv_idx
    GlooDispatch, _ = _layers()
    weights = topk_weights if topk_weights is not None else paddle.zeros(topk_idx.shape, dtype="float32")
    recv_x, recv_w = GlooDispatch.apply(x, weights, handle)
    states = {"handle": handle, "dispatched_indices": recv_idx, "tokens_per_expert": handle.tokens_per_expert}
    return recv_x, (recv_w if topk_weights is not None else None), states


def combine(y, group, handle, previous_event=None):
    """``fused_combine``'s contract on gloo: ``[num_tokens, H]``, each token's rows summed (module doc)."""
    if not isinstance(handle, FlexHandle):
        raise DeepEPAbsentError(f"fused_combine: the handle {type(handle).__name__} is not a gloo dispatch's; "
                                f"combine what deepep_gloo.dispatch dispatched. {WHERE}")
    _check("fused_combine", handle.group, y)
    if y.ndim != 2 or y.shape[0] != sum(handle.recv_counts):
        raise ValueError(f"deepep_gloo: combine got {list(y.shape)}; the dispatch delivered "
                         f"{sum(handle.recv_counts)} rows. {WHERE}")
    _, GlooCombine = _layers()
    return GlooCombine.apply(y, handle)
