"""One rank of ``test_reshard_table.py``: every reshard between the placements Replicate, Shard(0),
Shard(1) and Partial on a 1-D mesh of all ranks, between every pair of 2-D placements on a
2 x 2 mesh, and from one mesh to another, each against what one process holds: NumPy's chunk
of the global tensor a rank should hold after the reshard.

The global tensor has small integer values, so every sum is exact: a wrong byte, a wrong peer or
a missing reduction is a wrong number, not a tolerance question.  A Partial source is built from
per-rank addends (``dtensor_from_local``) that sum to the global tensor over the partial mesh
dimensions.  Each case records the local value or, if Paddle raised, the error text: the test
names every case that raised or differs.

Environment: ``W_ROWS`` (rows of the global tensor, default twice the ranks; its columns are
always twice the ranks; uneven rows give uneven shards); ``W_STOCK=1`` uninstalls the plugin first (what Paddle alone does).
"""
import itertools
import os

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid
from paddle_hybrid.testing import save_result

PLACEMENTS = {"R": dist.Replicate, "S0": lambda: dist.Shard(0), "S1": lambda: dist.Shard(1), "P": dist.Partial}


def make(names):
    return [PLACEMENTS[n]() for n in names]


def chunk(array: np.ndarray, axis: int, parts: int, index: int) -> np.ndarray:
    """Paddle's split of a sharded dimension: ``ceil(n / parts)`` a rank, the last ones shorter
    or empty (``paddle.chunk``'s rule, not NumPy's ``array_split``)."""
    size = -(-array.shape[axis] // parts)
    start = min(index * size, array.shape[axis])
    stop = min(start + size, array.shape[axis])
    return np.take(array, np.arange(start, stop), axis=axis)


def local_of(whole: np.ndarray, mesh_shape, coord, names) -> np.ndarray:
    """What the rank at ``coord`` holds of ``whole`` under ``names`` (Partial: the whole value)."""
    local = whole
    for dim, name in enumerate(names):
        if name in ("S0", "S1"):
            local = chunk(local, int(name[1]), mesh_shape[dim], coord[dim])
    return local


def addend(whole: np.ndarray, mesh_shape, coord, names) -> np.ndarray:
    """This rank's share of a Partial value: over the partial mesh dimensions the shares sum to
    the rank's local value; the first member holds the value less everybody else's share."""
    local = local_of(whole, mesh_shape, coord, names)
    partial_dims = [d for d, n in enumerate(names) if n == "P"]
    members = int(np.prod([mesh_shape[d] for d in partial_dims])) if partial_dims else 1
    if members == 1:
        return local
    share = (np.arange(local.size).reshape(local.shape) % 3 + 1).astype(local.dtype)
    first = all(coord[d] == 0 for d in partial_dims)
    return local - (members - 1) * share if first else share


def source_tensor(whole, mesh, coord, names):
    if "P" in names:
        part = addend(whole, mesh.shape, coord, names)
        return dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(part), mesh, make(names))
    return dist.shard_tensor(paddle.to_tensor(whole), mesh, make(names))


def one_case(whole, src_mesh, src, dst_mesh, dst, rank) -> dict:
    src_coord = _coord(src_mesh, rank)
    dst_coord = _coord(dst_mesh, rank)
    try:
        tensor = source_tensor(whole, src_mesh, src_coord, src) if src_coord is not None else \
            _placeholder(whole, src_mesh, src)
        out = dist.reshard(tensor, dst_mesh, make(dst))
    except Exception as exc:  # noqa: BLE001  (the error is the result the test reports)
        return {"error": f"{type(exc).__name__}: {str(exc)[-400:]}"}
    if dst_coord is None:
        return {"outside": True}
    got = out._local_value().numpy()
    if "P" in dst:  # a Partial result: its shares must add up to the value, checked by the test
        return {"got": got.tolist(), "partial": True, "coord": list(dst_coord),
                "expected": local_of(whole, dst_mesh.shape, dst_coord, dst).tolist()}
    expected = local_of(whole, dst_mesh.shape, dst_coord, dst)
    return {"got": got.tolist(), "expected": expected.tolist(), "shape": list(got.shape),
            "expected_shape": list(expected.shape)}


def _placeholder(whole, mesh, names):
    """A rank outside the source mesh still takes part in the reshard call (as in a pipeline):
    it holds a tensor of the source mesh with no local data of its own."""
    return dist.shard_tensor(paddle.to_tensor(whole), mesh, make(names))


def _coord(mesh, rank):
    ids = np.asarray(mesh.process_ids).reshape(mesh.shape)
    where = np.argwhere(ids == rank)
    return tuple(int(i) for i in where[0]) if len(where) else None


def main() -> None:
    if os.environ.get("W_STOCK") == "1":
        paddle_hybrid.uninstall()
    dist.init_parallel_env()
    rank, nranks = dist.get_rank(), dist.get_world_size()
    rows = int(os.environ.get("W_ROWS", 2 * nranks))
    whole = np.arange(rows * 2 * nranks, dtype="float32").reshape(rows, 2 * nranks) % 7 + 1
    cases = {}
    flat = dist.ProcessMesh(list(range(nranks)), dim_names=["x"])
    for src, dst in itertools.product(PLACEMENTS, repeat=2):
        if src != dst:
            cases[f"1-D {src} -> {dst}"] = one_case(whole, flat, [src], flat, [dst], rank)
    if nranks == 4:
        grid = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        layouts = [p for p in itertools.product(PLACEMENTS, repeat=2)
                   if not (p[0] == p[1] and p[0].startswith("S"))]  # a dimension sharded twice
        for src, dst in itertools.product(layouts, repeat=2):
            if src != dst:
                cases[f"2-D {''.join(src)} -> {''.join(dst)}"] = one_case(whole, grid, list(src), grid, list(dst), rank)
        left, right = dist.ProcessMesh([0, 1], dim_names=["x"]), dist.ProcessMesh([2, 3], dim_names=["x"])
        for src, dst in itertools.product(PLACEMENTS, ("R", "S0", "S1")):
            cases[f"mesh [0,1] {src} -> mesh [2,3] {dst}"] = one_case(whole, left, [src], right, [dst], rank)
    save_result({"rank": rank, "cases": cases})


if __name__ == "__main__":
    main()
