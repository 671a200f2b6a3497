"""One rank of the shared-memory collectives check (``paddle_hybrid.gloo.local_ring``).

CASE=values: all_reduce (SUM / MAX / MIN / PROD of float32, float64, int64 with 1, 7 and 600000
elements, the last in chunks; float16 takes gloo's path), reduce to each rank, broadcast (float32, bool, float16, from
each rank), all_gather (a list, a given list, into a tensor), a group of all ranks but the first,
a non-contiguous slice (gloo's path: refused), then one all_reduce after
``paddle_hybrid.uninstall()``; each result and the path taken saved.  CASE=no_shm: a segment
larger than /dev/shm (the group stays on gloo, with a warning).  CASE=late: the last rank skips
one all_reduce (the others must stop at the deadline naming it).  CASE=dies: the last rank exits
(code 0, so the launcher lets the others run) before an all_reduce; the others must stop at once
naming it."""
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401
from paddle_hybrid.gloo import local_ring
from paddle_hybrid.testing import save_result

CASE = os.environ.get("CASE", "values")


def part(shape, dtype, seed):
    rng = np.random.RandomState(seed)
    if dtype.startswith("int"):
        return rng.randint(-50, 50, size=shape).astype(dtype)
    return rng.uniform(-2, 2, size=shape).astype(dtype)


def reduces(rank, world):
    """``reduce`` to each rank: ``{"<op>/<dtype>/<size>/<dst>": (this rank's input, what it holds after)}``."""
    out = {}
    for dtype, name, op, size in (("float32", "sum", dist.ReduceOp.SUM, 7), ("float32", "sum", dist.ReduceOp.SUM, 600000),
                                  ("int64", "max", dist.ReduceOp.MAX, 7), ("float32", "prod", dist.ReduceOp.PROD, 7)):
        for dst in range(world):
            given = part([size], dtype, 100 * rank + size + dst)
            x = paddle.to_tensor(given)
            dist.reduce(x, dst=dst, op=op)
            out[f"{name}/{dtype}/{size}/{dst}"] = (given, x.numpy())
    return out


def values(rank, world):
    out = {}
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PROD}
    for dtype in ("float32", "float64", "int64", "float16"):
        for size in (1, 7, 600000):  # gloo refuses 0 elements
            for name, op in ops.items():
                if size == 600000 and name == "prod":
                    continue
                x = paddle.to_tensor(part([size], dtype, 100 * rank + size))
                dist.all_reduce(x, op=op)
                out[f"all_reduce/{name}/{dtype}/{size}"] = x.numpy()
    for dtype in ("float32", "bool", "float16"):
        for src in range(world):
            if dtype == "bool":
                x = paddle.to_tensor(np.arange(5) % (rank + 2) == 0)
            else:
                x = paddle.to_tensor(part([3, 5], dtype, 7 * rank + src))
            dist.broadcast(x, src=src)
            out[f"broadcast/{dtype}/{src}"] = x.numpy()
    x = paddle.to_tensor(part([4, 3], "float32", rank))
    parts = []
    dist.all_gather(parts, x)
    out["all_gather/list"] = np.stack([p.numpy() for p in parts])
    kept = [paddle.zeros([4, 3]) for _ in range(world)]
    dist.all_gather(kept, x)
    out["all_gather/given_list"] = np.stack([p.numpy() for p in kept])
    whole = paddle.zeros([4 * world, 3])
    dist.stream.all_gather(whole, x)
    out["all_gather/into_tensor"] = whole.numpy()
    # a group of the ranks but the first: its ranks are not the global ones (broadcast from its last)
    sub = dist.new_group(list(range(1, world)))
    if rank >= 1 and world >= 3:  # a one-rank group is no group in Paddle
        x = paddle.to_tensor(part([5], "float32", 11 + rank))
        dist.broadcast(x, src=world - 1, group=sub)
        out["sub/broadcast"] = x.numpy()
        y = paddle.to_tensor(part([5], "float32", 13 + rank))
        dist.all_reduce(y, group=sub)
        out["sub/all_reduce"] = y.numpy()
        parts = []
        dist.all_gather(parts, x, group=sub)
        out["sub/all_gather"] = np.stack([p.numpy() for p in parts])
    base = paddle.to_tensor(part([4, 6], "float32", 3 + rank))
    try:  # gloo refuses a non-contiguous tensor; the shared-memory path leaves it to gloo
        dist.all_reduce(base[:, 1:4])
        out["all_reduce/slice"] = base.numpy()
    except ValueError as exc:
        out["all_reduce/slice"] = np.array(["must be contiguous" in str(exc)])
    return out


def main():
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world}
    if CASE == "values":
        result["values"] = values(rank, world)
        result["reduce"] = reduces(rank, world)
        # uninstalled: the rings are unmapped and collectives are gloo's again
        result["rings_before_uninstall"] = len(local_ring._rings)
        paddle_hybrid.uninstall()
        x = paddle.full([2], float(rank + 1))
        dist.all_reduce(x)
        result["after_uninstall"] = {"rings": len(local_ring._rings), "sum": x.numpy().tolist(),
                                     "calls": local_ring.calls()["all_reduce"]}
    elif CASE == "no_shm":  # more shared memory than the machine has: the group must stay on gloo
        import warnings

        local_ring.SLOT_BYTES = 1 << 44
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            x = paddle.full([3], float(rank + 1))
            dist.all_reduce(x)
        result["sum"] = x.numpy().tolist()
        result["warnings"] = [str(w.message) for w in seen if "local_ring" in str(w.message)]
    else:
        x = paddle.ones([4])
        dist.all_reduce(x)  # sets the ring up
        if rank == world - 1:
            if CASE == "dies":  # exit 0: the launcher does not stop the others, they must find out
                os._exit(0)
        else:
            try:
                dist.all_reduce(x)
                result["error"] = None
            except Exception as exc:  # the named failure is the point
                result["error"] = (type(exc).__name__, str(exc))
        if CASE == "late" and rank == world - 1:
            import time

            time.sleep(float(os.environ["PADDLE_HYBRID_TIMEOUT"]) + 3)
    result["calls"] = local_ring.calls()
    save_result(result)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
