"""Replicas stay replicas: every ``PluginConfig.check_replicas`` optimizer steps, every parameter
that several ranks should hold alike is compared across them, and a difference stops every rank
naming the parameter, the group and the ranks (component ``replica_check``).

What should be alike (Megatron checks the first of these with
``--check-weight-hash-across-dp-replicas-interval``; nothing checks the others):

* within a **data-parallel**, a **sharding** and a **segment-parallel** group (sharding stage 1
  and group-sharded stage 2: each rank updates its share, then the whole parameter is sent to
  every rank): every parameter; with group-sharded stage 3 the parameters it slices are each
  rank's own slice, not compared;
* an **expert**'s parameters (expert parallel) only between the data-parallel ranks that hold the
  same experts (the same place in their expert-parallel groups);
* within a **tensor-parallel** group: every parameter that is not a slice (``is_distributed``
  unset): norms, biases of row-parallel layers, a replicated head.  One that differs there has
  a missing all-reduce (a partial gradient), or is sized per rank without being marked
  distributed;
* a weight a ``PipelineLayer`` **ties across stages** (``SharedLayerDesc``: the embedding and the
  LM head), on the ranks that hold it.

How: after the step, every rank publishes a digest of each parameter (BLAKE2b of its bytes,
:mod:`paddle_hybrid.common.logical_params`) and its groups through the job's store
(:mod:`paddle_hybrid.common.exchange`, bounded by ``PluginConfig.timeout``); every rank reads all
of them and makes the same comparison, so all stop together with the same message
(:class:`ReplicaMismatchError`).  Replicas updated by the same arithmetic are bitwise equal, so
the comparison is exact.  No collective, so a check cannot hang on a rank that is already
desynchronised; its cost is hashing the parameters and one store exchange (figures in
``docs/verify.md``).

Where: the optimizer that ``fleet.distributed_optimizer`` (or ``group_sharded_parallel``)
returns (its ``step``), for the model it last returned; PaddleFormers' Trainer goes through both
in every layout with more than one process.  Off by default (``PADDLE_HYBRID_CHECK_REPLICAS=0``); on any
device when set: it reads parameters and the store only.
"""
from __future__ import annotations

import functools
import weakref

from ...common.exchange import exchange
from ...common.replicas import compare, describe_rank
from ...registry.component import Component

__all__ = ["COMPONENT", "apply", "ReplicaMismatchError", "check"]


class ReplicaMismatchError(RuntimeError):
    """Ranks that should hold the same parameter hold different ones."""


_model = {"ref": None}


KIND_WORDS = {"mp": "tensor-parallel", "dp": "data-parallel", "sharding": "sharding", "sep": "segment-parallel",
              "tied": "pipeline-tied"}


def _message(found: list, step: int) -> str:
    kind, ranks, name, values = found[0]
    by_digest = {}
    for rank, value in values:
        by_digest.setdefault(value, []).append(rank)
    sides = "; ".join(f"ranks {r} hold {'nothing' if d is None else d[:12]}" for d, r in by_digest.items())
    why = {"mp": "a parameter every tensor-parallel rank holds whole has a different value on some: a missing "
                 "all-reduce of its gradient (a partial gradient), or a parameter sized per rank but not marked "
                 "is_distributed",
           "dp": "data-parallel replicas drifted apart: a gradient that was not all-reduced, or an update that "
                 "depends on the rank",
           "sharding": "sharding replicas drifted apart: a slice whose update was not sent to every rank",
           "sep": "segment-parallel replicas drifted apart: a gradient that was not summed over the sep group",
           "tied": "a weight tied across pipeline stages (the embedding and the LM head) was updated differently "
                   "on its stages: its gradients were not summed across them"}[kind]
    more = f" ({len(found) - 1} more differences)" if len(found) > 1 else ""
    return (f"paddle_hybrid replica check after step {step}: parameter {name!r} differs within the "
            f"{KIND_WORDS[kind]} group {list(ranks)}: {sides}{more}. {why}. "
            f"(PADDLE_HYBRID_CHECK_REPLICAS=0 turns the check off.)")


def check(model, step: int, timeout: float, setting: str) -> None:
    """Compare the replicas of ``model``'s parameters on every rank; raise
    :class:`ReplicaMismatchError` (on every rank) at the first difference."""
    import paddle.distributed as dist

    if dist.get_world_size() <= 1:
        return
    published = exchange(describe_rank(model), topic="replicas", ranks=list(range(dist.get_world_size())),
                         rank=dist.get_rank(), timeout=timeout, setting=setting)
    found = compare({int(r): v for r, v in published.items()})
    if found:
        raise ReplicaMismatchError(_message(found, step))


# -- where it hooks in -------------------------------------------------------------------------------

def _make_distributed_model(original):
    @functools.wraps(original)
    def distributed_model(model, *args, **kwargs):
        wrapped = original(model, *args, **kwargs)
        _model["ref"] = weakref.ref(wrapped)
        return wrapped

    return distributed_model


def _make_distributed_optimizer(original, config):
    @functools.wraps(original)
    def distributed_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        _checked(optimizer, config)
        return optimizer

    return distributed_optimizer


def _checked(optimizer, config) -> None:
    """Every ``config.check_replicas``-th ``optimizer.step()`` ends with a check of the model
    last wrapped."""
    every, step, count = config.check_replicas, optimizer.step, [0]

    @functools.wraps(step)
    def checked_step(*a, **k):
        result = step(*a, **k)
        count[0] += 1
        model = _model["ref"]() if _model["ref"] is not None else None
        if model is not None and count[0] % every == 0:
            check(model, count[0], config.seconds(), config.deadline_setting())
        return result

    optimizer.step = checked_step


def _make_group_sharded_parallel(original, config):
    """Group-sharded stages 2 and 3 wrap the model and the optimizer themselves."""
    @functools.wraps(original)
    def group_sharded_parallel(model, optimizer, *args, **kwargs):
        model, optimizer, scaler = original(model, optimizer, *args, **kwargs)
        _model["ref"] = weakref.ref(model)
        _checked(optimizer, config)
        return model, optimizer, scaler

    return group_sharded_parallel


def apply(config, patcher) -> str:
    import paddle.distributed.sharding as sharding
    from paddle.distributed import fleet
    from paddle.distributed.sharding import group_sharded

    model_fn = patcher.require(fleet, "distributed_model", "paddle.distributed.fleet")
    optimizer_fn = patcher.require(fleet, "distributed_optimizer", "paddle.distributed.fleet")
    sharded_fn = patcher.require(group_sharded, "group_sharded_parallel", "paddle.distributed.sharding.group_sharded")
    patcher.set(fleet, "distributed_model", _make_distributed_model(model_fn))
    patcher.set(fleet, "distributed_optimizer", _make_distributed_optimizer(optimizer_fn, config))
    wrapped = _make_group_sharded_parallel(sharded_fn, config)
    patcher.set(group_sharded, "group_sharded_parallel", wrapped)
    if getattr(sharding, "group_sharded_parallel", None) is sharded_fn:  # where scripts import it from
        patcher.set(sharding, "group_sharded_parallel", wrapped)
    return f"every {config.check_replicas} optimizer steps"


COMPONENT = Component("replica_check", ("3.2.", "3.3."), "check_replicas", apply)
