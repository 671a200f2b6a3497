"""Which parameters should be alike on which ranks, and which are not: a rank's description
(:func:`describe_rank`: its groups and a digest of each parameter) and the comparison of every
rank's (:func:`compare`), the same on every rank that reads them all.

Shared by :mod:`paddle_hybrid.dygraph.replica_check` (checks a running job) and
:mod:`paddle_hybrid.dygraph.verify_record` (records for ``python -m paddle_hybrid.verify``, which
reports what it finds).  Alike: every parameter within a data-parallel and a sharding group; every
parameter that is not a slice (``is_distributed``) within a tensor-parallel group; a weight tied
across pipeline stages on the ranks that hold it.
"""
from __future__ import annotations

from . import logical_params

__all__ = ["describe_rank", "compare"]


def describe_rank(model) -> dict:
    """What this rank publishes: its groups (global ranks) and a digest of every parameter."""
    kinds = {kind: ranks for kind, (_group, ranks) in logical_params.groups().items() if kind != "pp"}
    params = logical_params.named_parameters(model)
    return {
        "groups": kinds,
        "digests": {name: logical_params.digest(logical_params._array(p)) for name, p in params},
        "split": sorted(name for name, p in params if logical_params.is_split(p)),
        # an expert's parameters differ between the ranks of its data-parallel group by design
        # (expert parallel: fleet's MoE marks them no_sync / expert)
        "own": sorted(name for name, p in params if getattr(p, "no_sync", False) or getattr(p, "expert", False)),
        "tied": {key: {"ranks": ranks, "digest": logical_params.digest(logical_params._array(p))}
                 for key, p, ranks in logical_params.shared_weights(model)},
    }


def compare(published: dict) -> list:
    """Every difference among ``{global rank: describe_rank(...)}``, sorted, each
    ``(kind, ranks, parameter, {rank: digest})``; the same list on every rank."""
    found = set()
    for rank, entry in published.items():
        for kind, ranks in entry["groups"].items():
            members = [r for r in ranks if r in published]
            for name, value in entry["digests"].items():
                if kind == "mp" and name in entry["split"]:
                    continue  # each tensor-parallel rank holds its own slice
                if kind in ("dp", "sharding") and name in entry.get("own", ()):
                    continue  # an expert of this rank's own
                values = {r: published[r]["digests"].get(name) for r in members}
                if len(set(values.values())) > 1:
                    found.add((kind, tuple(members), name, tuple(sorted(values.items()))))
        for key, tied in entry["tied"].items():
            values = {r: published[r]["tied"].get(key, {}).get("digest") for r in tied["ranks"] if r in published}
            if len(set(values.values())) > 1:
                found.add(("tied", tuple(tied["ranks"]), key, tuple(sorted(values.items()))))
    return sorted(found)
