"""Pipeline p2p on gloo: every send/recv through the 2-rank group of its peer
(:func:`.groups.pair_group`), and batched p2p kept working.

1. ``_p2p_ops`` and ``SendRecvMeta.send_meta``/``recv_meta`` post on the pipeline group,
   whose single gloo tag counter desynchronises with two peers (PP >= 3 hangs).  Patch:
   the same operations in the same order, each on its peer's pair group.
2. Batched p2p (``pp_configs.use_batch_p2p_comm``, default True) sends on the calculation
   stream, which ``ProcessGroupGloo`` refuses.  Patch: on gloo the batched path posts the
   same ``isend``/``irecv`` pairs asynchronously on the pair groups and waits for all of
   them before returning, so the user's choice keeps working with the same results.

Each replacement first asks whether the pipeline group is gloo (the group ``hcg`` or the
caller hands it); on any other backend it calls Paddle's original with the same arguments.
"""
from __future__ import annotations

import functools

from ...registry.device import is_gloo
from ...gloo.groups import pair_group

__all__ = ["apply"]


def _make_p2p_ops(p2p, stock_p2p_ops, stock_batched):
    import paddle

    isend, irecv = paddle.distributed.isend, paddle.distributed.irecv
    post = p2p._p2p_ops_tuple_or_tensor

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

    p2p_ops, batched = _make_p2p_ops(p2p, p2p._p2p_ops, p2p._batched_p2p_ops)
    patcher.set(p2p, "_p2p_ops", p2p_ops)
    patcher.set(p2p, "_batched_p2p_ops", batched)
    send_meta, recv_meta = _make_meta(p2p, meta_cls.send_meta, meta_cls.recv_meta)
    patcher.set(meta_cls, "send_meta", send_meta)
    patcher.set(meta_cls, "recv_meta", recv_meta)
