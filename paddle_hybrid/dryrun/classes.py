"""Rank classes: the ranks of a fleet topology that hold and move the same, one run standing for each.

fleet numbers ranks row-major over its axes in the order of ``topology.get_hybrid_group_names()``
(the last axis varies fastest).  Two ranks hold the same parameters, gradients, optimizer state and
activations, and make the same calls on groups of the same shape, when they sit at the same
pipeline stage and the same sharding rank (sharding stage 1 gives each sharding rank its own
parameters to update; its optimizer state differs).  Data-parallel, tensor-parallel (fleet's layers
split evenly: it refuses a degree that does not divide), segment-parallel and context-parallel
ranks of one stage and sharding rank are alike; the dry run's tests check the claim by running
every rank of small layouts.

Each class is run by its representative: the rank with every other coordinate 0.  Representatives
of neighbouring stages are pipeline neighbours, so a stage's run receives the messages its
representative's predecessor sent (recorded by the fake world) and classes run in stage order.
"""
from __future__ import annotations

import itertools

__all__ = ["RankClass", "classes_of", "describe_ranks", "KEY_AXES", "coordinates", "corresponding_group"]

KEY_AXES = ("pipe", "sharding")  # the axes whose coordinate changes what a rank holds


class RankClass:
    def __init__(self, key: dict, ranks: list, representative: int):
        self.key = key
        self.ranks = ranks
        self.representative = representative

    @property
    def label(self) -> str:
        return " ".join(f"{axis} {value}" for axis, value in self.key.items()) or "every rank"

    def __repr__(self):
        return f"RankClass({self.label}: {describe_ranks(self.ranks)})"


def coordinates(names: list, degrees: dict) -> list:
    """Every rank's coordinate dict, by rank."""
    axes = [range(int(degrees[n])) for n in names]
    return [dict(zip(names, point)) for point in itertools.product(*axes)]


def classes_of(topology: dict | None, world_size: int) -> list:
    """The classes of a world (``topology`` as the probe records it: fleet's, or the semi-auto API's
    mesh with its own ``key_axes``; None: a script with neither, whose ranks are alike)."""
    if topology is None:
        return [RankClass({}, list(range(world_size)), 0)]
    names = topology["names"]
    coords = coordinates(names, topology["degrees"])
    if len(coords) != world_size:
        raise ValueError(f"fleet's topology has {len(coords)} ranks ({topology['degrees']}) in a world of {world_size}")
    keys = [axis for axis in topology.get("key_axes", KEY_AXES) if axis in names]
    grouped = {}
    for rank, coord in enumerate(coords):
        grouped.setdefault(tuple(coord[a] for a in keys), []).append(rank)
    out = []
    for key in sorted(grouped):
        ranks = grouped[key]
        representative = next(r for r in ranks if all(v == 0 for a, v in coords[r].items() if a not in keys))
        out.append(RankClass(dict(zip(keys, key)), ranks, representative))
    return out


def corresponding_group(group: list, source: int, target: int, coords: list) -> list:
    """The group of ``target`` that plays the part ``group`` plays for ``source``: each member moved to
    ``target``'s coordinates on the axes the group does not span (a tensor-parallel group of stage 0's
    sharding rank 0 becomes the one of sharding rank 1; a pipeline pair stays a pipeline pair)."""
    spanned = {axis for axis in coords[source] if len({coords[m][axis] for m in group}) > 1}
    index = {tuple(sorted(c.items())): rank for rank, c in enumerate(coords)}
    moved = []
    for member in group:
        place = {axis: (coords[member][axis] if axis in spanned else coords[target][axis]) for axis in coords[target]}
        moved.append(index[tuple(sorted(place.items()))])
    return moved


def describe_ranks(ranks) -> str:
    """``0-3, 8, 10-11``: sorted ranks as ranges."""
    ranks = sorted(ranks)
    parts, start, prev = [], None, None
    for r in ranks + [None]:
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    return ", ".join(parts)
