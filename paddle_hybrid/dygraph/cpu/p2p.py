"""Pipeline p2p on gloo: every send/recv through the 2-rank group of its peer
(:func:`.groups.pair_group`), and batched p2p kept working.

1. ``_p2p_ops`` and ``SendRecvMeta.send_meta``/``recv_meta`` post on the pipeline group,
   whose single gloo tag counter desynchronises with two peers (PP >= 3 hangs).  Patch:
   the same operations in the same order, each on its peer's pair group.
2. Batched p2p (``pp_configs.use_batch_p2p_comm``, default True) sends on the calculation
   stream, which ``ProcessGroupGloo`` refuses.  Patch: on gloo the batched path posts the
   same ``isend``/``irecv`` pairs asynchronously on the pair groups and waits for all of
   them before returning, so the user's choice keeps working with the same results.

3. A stage that hands on a tuple (PaddleFormers' pipes send hidden states, mask and positions)
   is sent as one message per tensor; on gloo each message is a round trip that costs about a
   millisecond on 2 cores.  With ``PluginConfig.pipeline_fused_p2p`` (on by default) the tensors
   of a tuple travel as one message of their bytes: the sender concatenates them as bytes, the
   receiver receives that many bytes and copies each tensor's part into the tensor Paddle
   allocated for it (from the shapes and dtypes the two stages agreed on in their first
   exchange, so both sides fuse the same tuples).  Bytes are copied, not converted: the values
   are the same.  Not with ``FLAGS_pp_check_naninf`` (Paddle checks each tensor it sends).

Each replacement first asks whether the pipeline group is gloo (the group ``hcg`` or the
caller hands it); on any other backend it calls Paddle's original with the same arguments.
"""
from __future__ import annotations

import functools

from ...common.tensor_bytes import copy_from_bytes, nbytes, paddle_checks_each_tensor, to_bytes
from ...registry.device import is_gloo
from ...gloo import fake_world
from ...gloo.groups import pair_group

__all__ = ["apply"]


class _FusedRecv:
    """The request of a tuple received as one message: waiting for it also copies each
    tensor's bytes into that tensor."""

    def __init__(self, request, flat, tensors):
        self._request, self._flat, self._tensors = request, flat, tensors

    def wait(self):
        self._request.wait()
        if self._flat is not None:
            copy_from_bytes(self._flat, self._tensors)
            self._flat = None


class _FusedSend:
    """The request of a tuple sent as one message; keeps the message alive until it is sent."""

    def __init__(self, request, flat):
        self._request, self._flat = request, flat

    def wait(self):
        self._request.wait()
        self._flat = None


def _fusable(tensors) -> bool:
    import paddle

    return (isinstance(tensors, tuple) and len(tensors) > 1 and all(isinstance(t, paddle.Tensor) for t in tensors)
            and not paddle_checks_each_tensor())


def _post_fused(tensors, func, peer, group, isend):
    """One message for the tuple ``tensors`` (see the module docstring, 3)."""
    import paddle

    if func is isend:
        flat = to_bytes(tensors)
        return [_FusedSend(func(flat, peer, group), flat)]
    flat = paddle.empty([sum(nbytes(t) for t in tensors)], dtype=paddle.uint8)
    fake_world.expect_payload(flat)  # a dry run: its values decide no shape (the tuple's came first)
    return [_FusedRecv(func(flat, peer, group), flat, tensors)]


def _make_p2p_ops(p2p, stock_p2p_ops, stock_batched, fuse_tuples: bool = True):
    import paddle

    isend, irecv = paddle.distributed.isend, paddle.distributed.irecv
    stock_post = p2p._p2p_ops_tuple_or_tensor

    def post(tensors, func, peer, group):
        if fuse_tuples and _fusable(tensors):
            return _post_fused(tensors, func, peer, group, isend)
        return stock_post(tensors, func, peer, group)

    def _pair_group_p2p(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
        """Paddle's ``_p2p_ops`` with the same order of operations, each on the
        2-rank group of its peer instead of the whole pipeline group."""
        prev_rank, next_rank = hcg._get_p2p_prev_rank(), hcg._get_p2p_next_rank()
        send_next = (tensor_send_next, isend, next_rank)
        recv_prev = (tensor_recv_prev, irecv, prev_rank)
        send_prev = (tensor_send_prev, isend, prev_rank)
        recv_next = (tensor_recv_next, irecv, next_rank)
        if hcg.get_stage_id() % 2 == 0:
            order = (send_next, recv_prev, send_prev, recv_next)
        else:
            order = (recv_prev, send_next, recv_next, send_prev)
        reqs = []
        for tensors, func, peer in order:
            if tensors is not None:
                reqs.extend(post(tensors, func, peer, pair_group(hcg, peer)))
        return reqs

    @functools.wraps(stock_p2p_ops)
    def _p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
        if not is_gloo(hcg.get_pipe_parallel_group()):
            return stock_p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg)
        return _pair_group_p2p(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg)

    @functools.wraps(stock_batched)
    def _batched_p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
        """``use_batch_p2p_comm=True`` on gloo: post every send/recv of the batch
        asynchronously, then wait for all (gloo has no calculation stream)."""
        if not is_gloo(hcg.get_pipe_parallel_group()):
            return stock_batched(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg)
        for req in _pair_group_p2p(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
            req.wait()

    return _p2p_ops, _batched_p2p_ops


def _make_meta(p2p, orig_send, orig_recv):
    @functools.wraps(orig_send)
    def send_meta(self, tensor, group, reverse=False, broadcast=False):
        if not broadcast and is_gloo(group):
            hcg = p2p._hcg
            peer = hcg._get_p2p_prev_rank() if reverse else hcg._get_p2p_next_rank()
            group = pair_group(hcg, peer)
        return orig_send(self, tensor, group, reverse=reverse, broadcast=broadcast)

    @functools.wraps(orig_recv)
    def recv_meta(self, group, reverse=False, broadcast=False):
        if not broadcast and is_gloo(group):
            hcg = p2p._hcg
            peer = hcg._get_p2p_next_rank() if reverse else hcg._get_p2p_prev_rank()
            group = pair_group(hcg, peer)
        return orig_recv(self, group, reverse=reverse, broadcast=broadcast)

    return send_meta, recv_meta


def apply(config, patcher) -> None:
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    meta_cls = p2p.SendRecvMeta
    hcg_args = ["tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next", "hcg"]
    patcher.check_params(p2p._p2p_ops, hcg_args, "p2p_communication._p2p_ops")
    patcher.check_params(p2p._batched_p2p_ops, hcg_args, "p2p_communication._batched_p2p_ops")
    patcher.check_params(p2p._p2p_ops_tuple_or_tensor, ["tensors", "p2p_func", "pp_rank", "pp_group"],
                         "p2p_communication._p2p_ops_tuple_or_tensor")
    patcher.check_params(meta_cls.send_meta, ["self", "tensor", "group", "reverse", "broadcast"],
                         "SendRecvMeta.send_meta")
    patcher.check_params(meta_cls.recv_meta, ["self", "group", "reverse", "broadcast"], "SendRecvMeta.recv_meta")
    patcher.require(p2p, "_hcg", "p2p_communication")

    p2p_ops, batched = _make_p2p_ops(p2p, p2p._p2p_ops, p2p._batched_p2p_ops,
                                     fuse_tuples=config.pipeline_fused_p2p)
    patcher.set(p2p, "_p2p_ops", p2p_ops)
    patcher.set(p2p, "_batched_p2p_ops", batched)
    send_meta, recv_meta = _make_meta(p2p, meta_cls.send_meta, meta_cls.recv_meta)
    patcher.set(meta_cls, "send_meta", send_meta)
    patcher.set(meta_cls, "recv_meta", recv_meta)
