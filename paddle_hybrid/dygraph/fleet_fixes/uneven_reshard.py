"""``dist.reshard`` of a tensor whose sharded dimension does not divide by the mesh.

Paddle splits a sharded dimension of ``n`` over ``k`` ranks as ``paddle.chunk`` does (``ceil(n/k)``
a rank, the last ones shorter).  Its C++ reshard functions handle that for Replicate -> Shard,
Partial -> Shard and Shard -> Replicate (padding the last part), but on every device:

* Shard(i) -> Shard(j) (``SToSReshardFunction``) reshapes each rank's part as if all were equal:
  "The 'shape' in ReshapeOp is invalid" on some ranks while the others enter the all-to-all and
  wait for them (seen: 5 rows on 2 ranks, 4 or 5 on 3; a hang until the comm timeout);
* a split that leaves a rank with nothing (4 rows on 3 ranks: 2, 2, 0) cannot leave its
  dimension: Shard -> Replicate gives that rank a tensor of shape ``[4, 6, 0]`` while the
  others time out (the empty part's local tensor is undefined, "DistTensor is not defined yet
  when `local_dims` method is called").

What this does (dygraph ``dist.reshard``; every rank decides alike from the global shape and the
placements, before any communication):

* an uneven Shard -> Shard on a mesh dimension goes through Replicate on that dimension
  (Shard -> Replicate, then Replicate -> Shard: a local slice), the values Paddle gives for an
  even split; autograd follows both steps;
* a source Shard with an empty part, resharded to anything else on that mesh dimension, stops
  with a ``ValueError`` that names the tensor dimension, the mesh and what to do, instead of a
  wrong shape or a hang.

A reshard inside Paddle's C++ (an operator's own input reshard) does not pass through the Python
``dist.reshard`` and is not covered.
"""
from __future__ import annotations

import functools

__all__ = ["apply", "plan", "UnevenReshardError"]


class UnevenReshardError(ValueError):
    """A reshard Paddle cannot do on any device: a sharded dimension leaves a rank empty."""


def _parts(size: int, ranks: int) -> list:
    each = -(-size // ranks)
    return [max(0, min(each, size - i * each)) for i in range(ranks)]


def _describe(placement) -> str:
    if placement.is_shard():
        return f"Shard({placement.get_dim()})"
    return "Partial" if placement.is_partial() else "Replicate"


def plan(shape, mesh_shape, src, dst) -> list | None:
    """The intermediate placements to reshard through (a list), or ``None`` when Paddle's own
    reshard is right.  Raises :class:`UnevenReshardError` where no route exists."""
    middle = list(src)
    for mesh_dim, (before, after) in enumerate(zip(src, dst)):
        if not before.is_shard() or _describe(before) == _describe(after):
            continue
        ranks = mesh_shape[mesh_dim]
        size = shape[before.get_dim()]
        if 0 in _parts(size, ranks):
            raise UnevenReshardError(
                f"dist.reshard: tensor dimension {before.get_dim()} of shape {list(shape)} is Shard over mesh "
                f"dimension {mesh_dim} of {ranks} ranks, which leaves a rank with nothing ({_parts(size, ranks)}); "
                f"Paddle cannot move it to {_describe(after)} on any device (a wrong shape or a hang). "
                f"Shard a dimension of at least {(ranks - 1) * -(-size // ranks) + 1} along that mesh "
                f"dimension, or make the tensor Replicate before sharding it.")
        if after.is_shard() and (size % ranks or shape[after.get_dim()] % ranks):
            from paddle.distributed import Replicate

            middle[mesh_dim] = Replicate()
    return middle if [_describe(p) for p in middle] != [_describe(p) for p in src] else None


def _same_mesh(tensor, mesh) -> bool:
    source = tensor.process_mesh
    return source is not None and source.shape == mesh.shape and source.process_ids == mesh.process_ids


def _make(original):
    @functools.wraps(original)
    def reshard(dist_tensor, mesh, placements):
        import paddle

        if paddle.in_dynamic_mode() and getattr(dist_tensor, "is_dist", lambda: False)() \
                and _same_mesh(dist_tensor, mesh):
            middle = plan(list(dist_tensor.shape), list(mesh.shape), dist_tensor.placements, placements)
            if middle is not None:
                dist_tensor = original(dist_tensor, mesh, middle)
        return original(dist_tensor, mesh, placements)

    return reshard


def apply(config, patcher) -> None:
    import paddle.distributed as dist
    from paddle.distributed.auto_parallel import api

    original = patcher.require(api, "reshard", "paddle.distributed.auto_parallel.api")
    patcher.check_params(original, ["dist_tensor", "mesh", "placements"], "paddle.distributed.reshard")
    replacement = _make(original)
    patcher.set(api, "reshard", replacement)
    if getattr(dist, "reshard", None) is original:
        patcher.set(dist, "reshard", replacement)
