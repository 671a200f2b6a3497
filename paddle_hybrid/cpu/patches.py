"""The five patches of :mod:`paddle_hybrid.cpu`, applied and reverted as a unit.

Every patched attribute is checked before anything is changed: it must exist
and (for functions) have the parameter names this module was written against,
otherwise :func:`apply` raises without touching Paddle.
"""
from __future__ import annotations

import functools
import inspect
import os
import socket
import threading

__all__ = ["apply", "revert", "applied", "PAIR_GROUPS_ATTR"]

# Attribute of HybridCommunicateGroup holding {peer global rank: 2-rank Group}.
PAIR_GROUPS_ATTR = "_ph_p2p_pair_groups"

_MISSING = object()
_lock = threading.RLock()
_saved: list[tuple[object, str, object]] = []  # (owner, name, original or _MISSING)


def applied() -> bool:
    return bool(_saved)


def _modules():
    import paddle.distributed.parallel as parallel
    from paddle.distributed.fleet.base import topology
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    return parallel, topology, p2p


def _check_params(fn, names, where):
    try:
        got = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        got = None
    if got != list(names):
        raise RuntimeError(
            f"paddle_hybrid.cpu: {where} has parameters {got}, expected {list(names)}; this Paddle "
            "differs from the one the CPU/gloo patches were written for. Set "
            "PADDLE_HYBRID_CPU_HYBRID=off (PluginConfig(cpu_hybrid='off')) to run without them."
        )


def _set(owner, name, value):
    _saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                   else getattr(owner, name, _MISSING)))
    setattr(owner, name, value)


# ---------------------------------------------------------------------------
# Fix 5: one rendezvous store per gloo group
# ---------------------------------------------------------------------------
# core.ProcessGroupGloo.create(store, rank, size, gid) runs two gloo
# connectFullMesh rendezvous: the GlooCommContext one on PrefixStore(str(gid),
# store), and a second one in the ProcessGroupGloo constructor on the *bare*
# store, under the keys "0" .. str(size - 1).  Those bare keys are shared by
# every gloo group of the job (the default group writes them first) and the
# TCPStore cannot delete keys, so a rank that reaches the second rendezvous
# before a peer has overwritten its key reads the peer's address from an
# *earlier* group: "Connection refused" / TIMEOUT / "sizeof(impl_) ==
# bytes.size()" / a hang, on whichever group loses the race.  Barriers and
# retries cannot close that window (it lies inside one C++ call).  Giving each
# new group its own TCPStore (hosted by its rank 0, address published on the
# global store under a gid-unique key) makes every key fresh.

_STORE_KEY = "paddle_hybrid/gloo_group_store/{}"
_group_stores: list = []  # keep the per-group stores (and their servers) alive


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _group_store(store, rank, world_size, group_id):
    from paddle.base import core

    timeout = int(os.getenv("FLAGS_stop_check_timeout", "900"))
    key = _STORE_KEY.format(group_id)
    if rank == 0:
        host = os.getenv("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0] or "127.0.0.1"
        port = _free_port()
        store.set(key, f"{host}:{port}")
        private = core.TCPStore(host, port, True, world_size, timeout)
    else:
        store.wait(key)
        host, port = store.get(key).decode().rsplit(":", 1)
        private = core.TCPStore(host, int(port), False, world_size, timeout)
    _group_stores.append(private)
    return private


def _make_new_pg_impl(orig_impl):
    @functools.wraps(orig_impl)
    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options,
                                group_id=0, *args, **kwargs):
        if backend == "gloo" and group_id != 0 and world_size > 1 and store is not None:
            store = _group_store(store, rank, world_size, group_id)
        return orig_impl(backend, store, rank, world_size, group_name, pg_options, group_id,
                         *args, **kwargs)

    return _new_process_group_impl


# ---------------------------------------------------------------------------
# Creation of the groups of fix 3: HybridCommunicateGroup.__init__
# ---------------------------------------------------------------------------

def _pair_list(topo):
    """Ring-neighbour pairs of every pipeline, in the same order on every rank."""
    pairs, seen = [], set()
    for ranks in topo.get_comm_list("pipe"):
        n = len(ranks)
        for i in range(n):
            a, b = ranks[i], ranks[(i + 1) % n]
            key = (min(a, b), max(a, b))
            if a != b and key not in seen:
                seen.add(key)
                pairs.append(key)
    return pairs


def _make_hcg_init(orig_init):
    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        import paddle.distributed as dist

        orig_init(self, *args, **kwargs)
        groups = {}
        if self._pp_degree > 1:
            # Every rank creates every pair group, in the same order.
            for a, b in _pair_list(self._topo):
                group = dist.new_group(ranks=[a, b])
                if self.global_rank == a:
                    groups[b] = group
                elif self.global_rank == b:
                    groups[a] = group
        setattr(self, PAIR_GROUPS_ATTR, groups)

    return __init__


# ---------------------------------------------------------------------------
# Fixes 2 and 3: pipeline p2p through per-neighbour groups
# ---------------------------------------------------------------------------

def _pair_group(hcg, peer):
    groups = getattr(hcg, PAIR_GROUPS_ATTR, None)
    if groups is None:
        raise RuntimeError(
            "paddle_hybrid.cpu: the hybrid communicate group was built before paddle_hybrid was "
            "installed, so it has no per-neighbour p2p groups (gloo needs them). "
            "Import paddle_hybrid before fleet.init()."
        )
    try:
        return groups[peer]
    except KeyError:
        raise RuntimeError(f"paddle_hybrid.cpu: no p2p group with rank {peer}; known peers "
                           f"{sorted(groups)}.") from None


def _make_p2p_ops(p2p):
    import paddle

    isend, irecv = paddle.distributed.isend, paddle.distributed.irecv
    post = p2p._p2p_ops_tuple_or_tensor

    def _p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
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
                reqs.extend(post(tensors, func, peer, _pair_group(hcg, peer)))
        return reqs

    def _batched_p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
        """``use_batch_p2p_comm=True`` on gloo: post every send/recv of the batch
        asynchronously, then wait for all (gloo has no calculation stream)."""
        if hcg.get_model_parallel_world_size() > 1:
            raise NotImplementedError(
                "paddle_hybrid.cpu: batched p2p with tensor parallelism (mp_degree > 1) is not "
                "supported on gloo; set strategy.hybrid_configs['pp_configs'].use_batch_p2p_comm = False.")
        for req in _p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
            req.wait()

    return _p2p_ops, _batched_p2p_ops


def _make_meta(p2p, orig_send, orig_recv):
    @functools.wraps(orig_send)
    def send_meta(self, tensor, group, reverse=False, broadcast=False):
        if not broadcast:
            hcg = p2p._hcg
            peer = hcg._get_p2p_prev_rank() if reverse else hcg._get_p2p_next_rank()
            group = _pair_group(hcg, peer)
        return orig_send(self, tensor, group, reverse=reverse, broadcast=broadcast)

    @functools.wraps(orig_recv)
    def recv_meta(self, group, reverse=False, broadcast=False):
        if not broadcast:
            hcg = p2p._hcg
            peer = hcg._get_p2p_next_rank() if reverse else hcg._get_p2p_prev_rank()
            group = _pair_group(hcg, peer)
        return orig_recv(self, group, reverse=reverse, broadcast=broadcast)

    return send_meta, recv_meta


# ---------------------------------------------------------------------------

def apply() -> None:
    """Apply every patch (idempotent)."""
    with _lock:
        if _saved:
            return
        import paddle.distributed.collective as collective

        parallel, topology, p2p = _modules()
        hcg_cls = topology.HybridCommunicateGroup
        meta_cls = p2p.SendRecvMeta
        # Check everything before changing anything.
        _check_params(hcg_cls.__init__, ["self", "topology", "hybrid_configs"], "HybridCommunicateGroup.__init__")
        hcg_args = ["tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next", "hcg"]
        _check_params(p2p._p2p_ops, hcg_args, "p2p_communication._p2p_ops")
        _check_params(p2p._batched_p2p_ops, hcg_args, "p2p_communication._batched_p2p_ops")
        _check_params(p2p._p2p_ops_tuple_or_tensor, ["tensors", "p2p_func", "pp_rank", "pp_group"],
                      "p2p_communication._p2p_ops_tuple_or_tensor")
        _check_params(meta_cls.send_meta, ["self", "tensor", "group", "reverse", "broadcast"],
                      "SendRecvMeta.send_meta")
        _check_params(meta_cls.recv_meta, ["self", "group", "reverse", "broadcast"], "SendRecvMeta.recv_meta")
        _check_params(collective._new_process_group_impl,
                      ["backend", "store", "rank", "world_size", "group_name", "pg_options", "group_id",
                       "nccl_comm_init_option", "nccl_config"], "collective._new_process_group_impl")
        if not hasattr(p2p, "_hcg"):
            raise RuntimeError("paddle_hybrid.cpu: p2p_communication has no _hcg; unexpected Paddle.")

        try:
            # Fix 1: PipelineLayer reads ParallelEnv().device_id on every device type.
            if "_device_id" not in vars(parallel.ParallelEnv):
                _set(parallel.ParallelEnv, "_device_id", 0)
            # Fix 5: a private rendezvous store for every new gloo group.
            _set(collective, "_new_process_group_impl",
                 _make_new_pg_impl(collective._new_process_group_impl))
            # The pair groups of fix 3, made after fleet's own groups.
            _set(hcg_cls, "__init__", _make_hcg_init(hcg_cls.__init__))
            # Fixes 2 and 3.
            p2p_ops, batched = _make_p2p_ops(p2p)
            _set(p2p, "_p2p_ops", p2p_ops)
            _set(p2p, "_batched_p2p_ops", batched)
            send_meta, recv_meta = _make_meta(p2p, meta_cls.send_meta, meta_cls.recv_meta)
            _set(meta_cls, "send_meta", send_meta)
            _set(meta_cls, "recv_meta", recv_meta)
        except BaseException:
            revert()
            raise


def revert() -> None:
    """Undo every patch, newest first."""
    with _lock:
        while _saved:
            owner, name, original = _saved.pop()
            if original is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
