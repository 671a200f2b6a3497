"""Which parameters should be alike on which ranks, and which are not: a rank's description
(:func:`describe_rank`: its groups and a digest of each parameter) and the comparison of every
rank's (:func:`compare`), the same on every rank that reads them all.

Shared by :mod:`paddle_hybrid.dygraph.replica_check` (checks a running job) and
:mod:`paddle_hybrid.dygraph.verify_record` (records for ``python -m paddle_hybrid.verify``, which
reports what it finds).  Alike:

* every parameter within a data-parallel, a sharding and a segment-parallel (sep) group; with
  group-sharded stages 2 and 3 (``group_sharded_parallel``, whose ranks fleet knows as data
  parallel) the group they shard over is named the sharding group, and a parameter stage 3 slices
  is this rank's own slice there (not compared);
* an expert's parameters (an MoE layer's ``experts``, or marked ``expert`` / ``no_sync``) only
  within the data-parallel replicas of its expert-parallel place: the ranks of the data-parallel
  group holding the same experts (the same rank in their expert group);
* every parameter that is not a slice (``is_distributed``) within a tensor-parallel group;
* a weight tied across pipeline stages on the ranks that hold it.
"""
from __future__ import annotations

from . import logical_params

__all__ = ["describe_rank", "compare", "inner_layer", "group_sharded", "expert_shards", "sliced_by_stage3"]

GROUP_SHARDED = ("GroupShardedStage2", "GroupShardedStage3")


def group_sharded(model):
    """``(stage, group)`` when ``model`` is (inside fleet's wrappers) a group-sharded stage 2 or 3
    wrapper, else None."""
    layer = logical_params.unwrap(model)
    name = type(layer).__name__
    if name not in GROUP_SHARDED:
        return None
    return (2 if name == "GroupShardedStage2" else 3), layer._group


def inner_layer(model):
    """The user's layer inside fleet's, ``paddle.DataParallel``'s and group sharding's wrappers."""
    layer = logical_params.unwrap(model)
    while type(layer).__name__ in GROUP_SHARDED:
        layer = logical_params.unwrap(layer._layer)
    return layer


def sliced_by_stage3(model) -> set:
    """Names (``param.name``) of the parameters group-sharded stage 3 keeps as slices, one a rank."""
    sharded = group_sharded(model)
    if sharded is None or sharded[0] != 3:
        return set()
    return set(logical_params.unwrap(model)._param2buffer_size)


def expert_shards(model) -> list:
    """``[(path, layer, group)]``: each MoE layer of the model (a sublayer with a ``LayerList`` of
    ``experts`` and an expert-parallel group of 2 or more ranks, Paddle's ``MoELayer`` calls it
    ``group``, PaddleFormers' ``moe_group``), its path in the model and its group."""
    import paddle

    found = []
    for path, layer in inner_layer(model).named_sublayers():
        experts = getattr(layer, "experts", None)
        group = getattr(layer, "group", None) or getattr(layer, "moe_group", None)
        if isinstance(experts, paddle.nn.LayerList) and getattr(group, "nranks", 1) > 1:
            found.append((path, layer, group))
    return found


def _groups(model) -> dict:
    """``{kind: global ranks}`` of this rank's groups that should hold replicas."""
    kinds = {kind: ranks for kind, (_group, ranks) in logical_params.groups().items() if kind != "pp"}
    sep = _sep_ranks()
    if sep:
        kinds["sep"] = sep
    sharded = group_sharded(model)
    if sharded is not None:
        ranks = list(sharded[1].ranks)
        if kinds.get("dp") == ranks:  # fleet knows the group-sharded ranks as data parallel
            del kinds["dp"]
        kinds["sharding"] = ranks
    return kinds


def _sep_ranks() -> list:
    from paddle.distributed import fleet

    try:
        hcg = fleet.get_hybrid_communicate_group()
        group = hcg.get_sep_parallel_group() if hcg is not None and hcg.get_sep_parallel_world_size() > 1 else None
    except Exception:  # noqa: BLE001  (fleet not initialised, or a Paddle without sep)
        return []
    return list(group.ranks) if group is not None else []


def describe_rank(model, named: list | None = None) -> dict:
    """What this rank publishes: its groups (global ranks) and a digest of every parameter, named
    as ``named`` gives them (``[(name, parameter)]``; default the model's own names)."""
    params = named if named is not None else logical_params.named_parameters(inner_layer(model))
    slices = sliced_by_stage3(model)
    expert_ids, expert_index = set(), None
    for _path, layer, group in expert_shards(model):
        expert_ids.update(id(p) for p in layer.experts.parameters())
        expert_index = group.rank
    names = {id(p): name for name, p in params}
    experts = sorted(name for name, p in params if id(p) in expert_ids or (expert_index is not None and
                                                                         getattr(p, "expert", False)))
    return {
        "groups": _groups(model),
        "digests": {name: logical_params.digest(_held(p, slices)) for name, p in params},
        "split": sorted(name for name, p in params if logical_params.is_split(p)),
        # differ between the ranks of their data-parallel and sharding groups by design: a stage-3
        # slice, a parameter marked no_sync or expert outside an MoE layer this code knows
        "own": sorted(name for name, p in params if name not in experts and (
            p.name in slices or getattr(p, "no_sync", False) or getattr(p, "expert", False))),
        "experts": experts,
        "expert_index": expert_index,
        "tied": {key: {"ranks": ranks, "digest": logical_params.digest(logical_params._array(p)),
                       "name": names.get(id(p), key)}
                 for key, p, ranks in logical_params.shared_weights(model)},
    }


def _held(param, slices: set):
    """What this rank holds of ``param``: a stage-3 slice between steps is in ``fw_storage``."""
    if param.name in slices and getattr(param, "fw_storage", None) is not None:
        return logical_params._array(param.fw_storage)
    return logical_params._array(param)


def _members(entry: dict, kind: str, name: str, ranks: list, published: dict) -> list | None:
    """The ranks of group ``ranks`` that should hold ``name`` alike with this one, or None."""
    members = [r for r in ranks if r in published]
    if kind == "mp" and name in entry["split"]:
        return None  # each tensor-parallel rank holds its own slice
    if kind in ("dp", "sharding", "sep") and name in entry.get("own", ()):
        return None
    if kind in ("dp", "sharding") and name in entry.get("experts", ()):
        # the replicas of this rank's experts: the ranks with the same place in their expert group
        members = [r for r in members if published[r].get("expert_index") == entry.get("expert_index")]
    return members


def compare(published: dict) -> list:
    """Every difference among ``{global rank: describe_rank(...)}``, sorted, each
    ``(kind, ranks, parameter, {rank: digest})``; the same list on every rank."""
    found = set()
    for rank, entry in published.items():
        for kind, ranks in entry["groups"].items():
            for name in entry["digests"]:
                members = _members(entry, kind, name, ranks, published)
                if not members or len(members) < 2:
                    continue
                values = {r: published[r]["digests"].get(name) for r in members}
                if len(set(values.values())) > 1:
                    found.add((kind, tuple(members), name, tuple(sorted(values.items()))))
        for key, tied in entry["tied"].items():
            values = {r: published[r]["tied"].get(key, {}).get("digest") for r in tied["ranks"] if r in published}
            if len(set(values.values())) > 1:
                found.add(("tied", tuple(tied["ranks"]), tied.get("name", key), tuple(sorted(values.items()))))
    return sorted(found)
