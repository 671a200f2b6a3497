"""Gloo groups: a rendezvous of its own per group, and one 2-rank group per pair of pipeline
neighbours.

1. Creating gloo groups fails now and then at start-up (``Connection refused``, a pair
   ``TIMEOUT`` or a hang; ~40% of 3-rank launches of stock Paddle 3.3.1 here).
   ``core.ProcessGroupGloo.create(store, rank, size, gid)`` runs two rendezvous: one on
   ``PrefixStore(str(gid), store)`` and a second, in the ``ProcessGroupGloo`` constructor,
   on the *bare* store under the keys "0" .. str(size - 1).  Those keys are shared by every
   gloo group of the job and a TCPStore cannot delete keys, so a rank that reaches the
   second rendezvous before a peer has overwritten its key reads the peer's address from
   an *earlier* group.  The window lies inside one C++ call, so barriers and retries
   cannot close it.  Patch: ``collective._new_process_group_impl`` hands every new gloo
   group a view of the job's store whose keys carry a prefix unique to the group id
   (:mod:`paddle_hybrid.gloo.prefix_store`): no group reads another's keys, and no store of
   its own is opened (no listening socket).
   Before the rendezvous the group's ranks meet in the job's store (each adds its bit to a
   presence counter, :mod:`paddle_hybrid.common.exchange`), for at most ``PluginConfig.timeout``
   (``PADDLE_HYBRID_TIMEOUT``): a rank whose peers never create the group (one rank calls
   ``new_group`` once more than the others) gets a ``TimeoutError`` naming them, where it used to
   wait silently for ``FLAGS_stop_check_timeout`` (900 s).  The rendezvous on the view obeys the
   same deadline.
2. Gloo tags every operation with one counter per group, so p2p with two different peers
   in one pipeline group desynchronises the tags (PP >= 3 hangs).  Patch:
   ``HybridCommunicateGroup.__init__`` also creates one 2-rank group per pair of ring
   neighbours, in the same order on every rank, after fleet's own groups, when the pipeline
   group is gloo (on NCCL/BKCL nothing is added); fleet's pipeline p2p on CPU
   (:mod:`paddle_hybrid.dygraph.cpu.p2p`) sends through them (:func:`pair_group`).
"""
from __future__ import annotations

import functools
import sys

from ..common import exchange
from ..registry.device import is_gloo
from .prefix_store import prefix_store

__all__ = ["apply", "pair_group", "pair_list", "PAIR_GROUPS_ATTR"]

# Attribute of HybridCommunicateGroup holding {peer global rank: 2-rank Group}.
PAIR_GROUPS_ATTR = "_ph_p2p_pair_groups"

# Where a group's rendezvous keys live on the job's store.
_RENDEZVOUS_PREFIX = "paddle_hybrid/gloo_group/{}/rendezvous/"


# ---------------------------------------------------------------------------
# 1. a rendezvous of its own per gloo group
# ---------------------------------------------------------------------------

def _members_being_created(world_size: int):
    """Global ranks of the group Paddle's ``new_group`` is creating (its sorted local ``ranks``,
    read from its frame: ``_new_process_group_impl`` is given only this rank's index), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        ranks = frame.f_locals.get("ranks") if frame.f_code.co_name == "new_group" else None
        if isinstance(ranks, (list, tuple)) and len(ranks) == world_size:
            return sorted(ranks)
        frame = frame.f_back
    return None


def _meet(store, rank, world_size, group_id, timeout: float, members) -> None:
    """Every rank of the new group arrives within ``timeout`` seconds, or a TimeoutError names
    those that did not (by global rank from ``members``, else by place in the group)."""
    local = list(range(world_size))
    key = f"paddle_hybrid/gloo_group/{group_id}"
    missing = exchange.wait_for(store, key, local, exchange.arrive(store, key, local, rank), timeout)
    if not missing:
        return
    if members:
        group, who = f"gloo group {group_id} of ranks {members}", exchange.describe_ranks([members[i] for i in missing])
    else:  # only the ranks' places in the group are known
        group, who = f"gloo group {group_id}", "group " + exchange.describe_ranks(missing)
    raise TimeoutError(
        f"paddle_hybrid: new_group ({group}) waited "
        f"{timeout:g} s for {who}, which did not create the group: every rank of a group must call new_group "
        "for it, in the same order as the others (crashed, hung, or running other code?). The deadline is "
        "PADDLE_HYBRID_TIMEOUT.")


def _group_store(store, rank, world_size, group_id, timeout: float):
    """The view of the job's store the new group rendezvouses on, once all its ranks are there
    (each within ``timeout`` seconds)."""
    members = _members_being_created(world_size)
    _meet(store, rank, world_size, group_id, timeout, members)
    places = [f"rank {m}" for m in members] if members else [f"group rank {i}" for i in range(world_size)]
    return prefix_store(store, _RENDEZVOUS_PREFIX.format(group_id), timeout,
                        f"rendezvous of gloo group {group_id} (deadline PADDLE_HYBRID_TIMEOUT)", places)


def _make_new_pg_impl(orig_impl, timeout: float):
    @functools.wraps(orig_impl)
    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options,
                                group_id=0, *args, **kwargs):
        # The group does not exist yet, so its backend name is what says whether it is gloo.
        if backend == "gloo" and group_id != 0 and world_size > 1 and store is not None:
            store = _group_store(store, rank, world_size, group_id, timeout)
        return orig_impl(backend, store, rank, world_size, group_name, pg_options, group_id,
                         *args, **kwargs)

    return _new_process_group_impl


# ---------------------------------------------------------------------------
# 2. per-neighbour p2p groups, made in HybridCommunicateGroup.__init__
# ---------------------------------------------------------------------------

def pair_list(topo):
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
        # Every rank asks the same question of a group with one backend for the whole job, so
        # either every rank creates every pair group or none does.
        if self._pp_degree > 1 and is_gloo(self.get_pipe_parallel_group()):
            for a, b in pair_list(self._topo):  # every rank creates every pair group
                group = dist.new_group(ranks=[a, b])
                if self.global_rank == a:
                    groups[b] = group
                elif self.global_rank == b:
                    groups[a] = group
        setattr(self, PAIR_GROUPS_ATTR, groups)

    return __init__


def pair_group(hcg, peer):
    """The 2-rank gloo group of this rank and pipeline neighbour ``peer``."""
    groups = getattr(hcg, PAIR_GROUPS_ATTR, None)
    if groups is None:
        raise RuntimeError(
            "paddle_hybrid.gloo: the hybrid communicate group was built before paddle_hybrid was "
            "installed, so it has no per-neighbour p2p groups (gloo needs them). "
            "Import paddle_hybrid before fleet.init()."
        )
    try:
        return groups[peer]
    except KeyError:
        raise RuntimeError(f"paddle_hybrid.gloo: no p2p group with rank {peer}; known peers "
                           f"{sorted(groups)} (pair groups are made only when the pipeline group is "
                           "gloo).") from None


def apply(config, patcher) -> None:
    """Every new gloo group meets on its own keys of the job's store within ``config.timeout``
    seconds; a hybrid communicate group with a gloo pipeline makes its per-neighbour pair groups."""
    import paddle.distributed.collective as collective
    from paddle.distributed.fleet.base import topology

    hcg_cls = topology.HybridCommunicateGroup
    patcher.check_params(hcg_cls.__init__, ["self", "topology", "hybrid_configs"],
                         "HybridCommunicateGroup.__init__")
    patcher.check_params(collective._new_process_group_impl,
                         ["backend", "store", "rank", "world_size", "group_name", "pg_options", "group_id",
                          "nccl_comm_init_option", "nccl_config"], "collective._new_process_group_impl")
    patcher.set(collective, "_new_process_group_impl", _make_new_pg_impl(collective._new_process_group_impl,
                                                                           float(config.timeout)))
    patcher.set(hcg_cls, "__init__", _make_hcg_init(hcg_cls.__init__))


def ensure_process_group() -> None:
    """Create the job's default group (ring 0 of a static program: gloo on CPU, NCCL on a GPU)
    and with it the job's TCP store, once, if there is more than one rank."""
    import paddle
    import paddle.distributed as dist

    if dist.get_world_size() <= 1 or dist.is_initialized():
        return
    with paddle.base.dygraph.guard():
        dist.init_parallel_env()
