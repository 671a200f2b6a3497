"""One rank of ``test_gloo_kernels.py``: semi-auto reshards that need reduce_scatter, all_to_all and
send/recv, each against the NumPy value of the same global tensor (what one process gives).

Every rank builds every rank's local data (deterministic), so each can compute the expected
global value itself.  It runs the cases with the plugin as installed, then uninstalls it and runs
one reshard again (Paddle's own kernel must be back).
"""
import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid
from paddle_hybrid.testing import save_result

DTYPES = ["float32", "float64", "int32", "int64", "int8", "uint8", "bool"]


def local_part(rank: int, rows: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s addend of a Partial tensor (small integers: exact in every dtype)."""
    values = (np.arange(rows * 3).reshape(rows, 3) * (rank + 2)) % 5
    return values.astype(bool) if dtype == "bool" else values.astype(dtype)


def partial_to_shard(mesh, nranks: int, rank: int, dtype: str, rows_per_rank: int) -> dict:
    rows = rows_per_rank * nranks
    local = local_part(rank, rows, dtype)
    total = np.any([local_part(r, rows, dtype) for r in range(nranks)], axis=0) if dtype == "bool" else \
        np.sum([local_part(r, rows, dtype) for r in range(nranks)], axis=0).astype(dtype)
    tensor = dist.auto_parallel.api.dtensor_from_local(paddle.to_tensor(local), mesh, [dist.Partial()])
    out = dist.reshard(tensor, mesh, [dist.Shard(0)])._local_value().numpy()
    expected = total[rank * rows_per_rank:(rank + 1) * rows_per_rank]
    return {"got": out.tolist(), "expected": expected.tolist(), "shape": list(out.shape),
            "expected_shape": list(expected.shape)}


def shard_to_shard(mesh, nranks: int, rank: int, src: int, dst: int) -> dict:
    whole = np.arange(2 * nranks * 2 * nranks, dtype="float32").reshape(2 * nranks, 2 * nranks)
    tensor = dist.shard_tensor(paddle.to_tensor(whole), mesh, [dist.Shard(src)])
    out = dist.reshard(tensor, mesh, [dist.Shard(dst)])._local_value().numpy()
    expected = np.split(whole, nranks, axis=dst)[rank]
    return {"got": out.tolist(), "expected": expected.tolist()}


def across_meshes(nranks: int, rank: int) -> dict:
    """A pipeline's hand-over: a tensor on mesh [0] resharded onto mesh [n - 1]; the ranks in
    between are outside both meshes (Paddle asks GetDefaultPlace() there)."""
    value = np.arange(6, dtype="float32").reshape(2, 3) + 10
    source = dist.shard_tensor(paddle.to_tensor(value), dist.ProcessMesh([0]), [dist.Replicate()])
    out = dist.reshard(source, dist.ProcessMesh([nranks - 1]), [dist.Replicate()])
    got = out._local_value().numpy().tolist() if rank == nranks - 1 else None
    return {"got": got, "expected": value.tolist() if rank == nranks - 1 else None}


def reshard_error(mesh, nranks: int, rank: int) -> str:
    try:
        partial_to_shard(mesh, nranks, rank, "float32", 2)
    except Exception as exc:  # noqa: BLE001  (the message is the result)
        return str(exc)
    return ""


def main() -> None:
    dist.init_parallel_env()
    rank, nranks = dist.get_rank(), dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(nranks)), dim_names=["x"])
    from paddle_hybrid.gloo import kernels

    result = {"rank": rank, "cases": {}}
    for dtype in DTYPES:
        result["cases"][f"P->S(0) {dtype}"] = partial_to_shard(mesh, nranks, rank, dtype, 2)
    result["cases"]["P->S(0) zero-size"] = partial_to_shard(mesh, nranks, rank, "float32", 0)
    result["cases"]["S(0)->S(1)"] = shard_to_shard(mesh, nranks, rank, 0, 1)
    result["cases"]["S(1)->S(0)"] = shard_to_shard(mesh, nranks, rank, 1, 0)
    result["cases"]["mesh [0] -> mesh [n-1]"] = across_meshes(nranks, rank)
    result["calls"] = {k: kernels.calls(k) for k in kernels.KERNELS}
    paddle_hybrid.uninstall()
    result["after_uninstall"] = reshard_error(mesh, nranks, rank)
    save_result(result)


if __name__ == "__main__":
    main()
