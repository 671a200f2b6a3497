"""One rank of the shared-memory send/recv check (``paddle_hybrid.gloo.local_p2p``).

CASE=values: messages between neighbours in an order gloo completes too (even ranks send first):
float32 of 16 and 600000 elements (the second longer than a lane: it streams), int64, bool,
float16, zero elements, ``isend``/``irecv`` tasks, ``batch_isend_irecv``, a transposed (non-contiguous) send into a
strided view; with 3 ranks also a group of ranks 1 and 2 (group ranks are not global ranks); with
the shared-memory path, also every rank sending to the next before receiving (gloo's send waits
for the receive: that order times out there); each received value and the path taken saved.
CASE=length: rank 0 sends 4 elements to a receive of 5 (refused, naming both; the next receive
refused too).  CASE=late: rank 1 never sends (rank 0's receive stops at the deadline naming it).
CASE=dies: rank 1 exits (code 0) after the pair is set up; rank 0's receive stops at once."""
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401
from paddle_hybrid.gloo import local_p2p
from paddle_hybrid.testing import save_result

CASE = os.environ.get("CASE", "values")
SHARED = os.environ.get("PADDLE_HYBRID_LOCAL_P2P", "1") == "1"


def message(kind, sender):
    """What ``sender`` sends for case ``kind`` (every rank can make it)."""
    rng = np.random.RandomState(1000 * sender + len(kind))
    if kind == "f32_16":
        return rng.uniform(-2, 2, [16]).astype("float32")
    if kind == "f32_600000":
        return rng.uniform(-2, 2, [600000]).astype("float32")
    if kind == "i64":
        return rng.randint(-2**40, 2**40, [7]).astype("int64")
    if kind == "bool":
        return rng.uniform(size=[5]) > 0.5
    if kind == "f16":
        return rng.uniform(-2, 2, [3, 5]).astype("float16")
    if kind == "empty":
        return np.zeros([0], dtype="float32")
    raise KeyError(kind)


KINDS = ("f32_16", "f32_600000", "i64", "bool", "f16", "empty")


def exchange(rank, peer, first, kind, out, group=None):
    """Send ``kind`` to ``peer`` (a global rank, as ``paddle.distributed`` takes it, also in a
    group) and receive the peer's: the sender first when ``first``."""
    expected = message(kind, peer)
    got = paddle.to_tensor(np.zeros_like(expected))
    mine = paddle.to_tensor(message(kind, rank))
    steps = [lambda: dist.send(mine, dst=peer, group=group), lambda: dist.recv(got, src=peer, group=group)]
    for step in (steps if first else steps[::-1]):
        step()
    out[f"{kind}/{rank}<-{peer}"] = got.numpy()


def values(rank, world):
    out = {}
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer < world:
        for kind in KINDS:
            try:
                exchange(rank, peer, rank % 2 == 0, kind, out)
            except Exception as exc:  # what gloo says of a case, recorded beside the shared path's
                out[f"{kind}/{rank}<-{peer}"] = np.array([type(exc).__name__])
        # isend / irecv: tasks, waited for afterwards
        mine, got = paddle.to_tensor(message("f32_16", rank)), paddle.zeros([16])
        tasks = [dist.isend(mine, dst=peer), dist.irecv(got, src=peer)] if rank % 2 == 0 else \
            [dist.irecv(got, src=peer), dist.isend(mine, dst=peer)]
        for task in tasks:
            task.wait()
        out[f"isend/{rank}<-{peer}"] = got.numpy()
        # batch_isend_irecv: the process group's coalescing around the ops
        got = paddle.zeros([16])
        ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
        for task in dist.batch_isend_irecv(ops if rank % 2 == 0 else ops[::-1]):
            task.wait()
        out[f"batch/{rank}<-{peer}"] = got.numpy()
        # a transposed tensor sent, received into every other row of a larger one
        base = paddle.zeros([6, 3])
        sent = paddle.to_tensor(np.arange(6, dtype="float32").reshape([3, 2]) + 10 * rank).T
        try:
            if rank % 2 == 0:
                dist.send(sent, dst=peer)
                dist.recv(base[1:6:3], src=peer)
            else:
                dist.recv(base[1:6:3], src=peer)
                dist.send(sent, dst=peer)
            out[f"strided/{rank}<-{peer}"] = base.numpy()
        except Exception as exc:
            out[f"strided/{rank}<-{peer}"] = np.array([type(exc).__name__])
    if world >= 3:
        sub = dist.new_group([1, 2])
        if rank in (1, 2):  # group ranks 0 and 1
            exchange(rank, 3 - rank, rank == 1, "i64", out, group=sub)
            out[f"sub/{rank}"] = out.pop(f"i64/{rank}<-{3 - rank}")
    if SHARED:  # every rank sends first: completes only with buffered sends
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        dist.send(paddle.to_tensor(message("f32_16", rank)), dst=nxt)
        got = paddle.zeros([16])
        dist.recv(got, src=prv)
        out[f"ring/{rank}<-{prv}"] = got.numpy()
    return out


def main():
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world}
    if CASE == "values":
        result["values"] = values(rank, world)
    else:
        x = paddle.ones([4])
        if rank == 0:  # sets the pair up
            dist.send(x, dst=1)
        else:
            dist.recv(x, src=0)
        if rank == 1 and CASE == "dies":  # exit 0: the launcher does not stop rank 0, it must find out
            os._exit(0)
        if CASE == "length" and rank == 0:
            dist.send(paddle.ones([4]), dst=1)
        elif CASE == "length" and rank == 1:
            errors = []
            for size in (5, 4):
                try:
                    dist.recv(paddle.zeros([size]), src=0)
                except Exception as exc:  # the named refusal is the point
                    errors.append((type(exc).__name__, str(exc)))
            result["errors"] = errors
        elif rank == 0:  # late, dies: rank 1 sends nothing
            started = time.monotonic()
            try:
                dist.recv(x, src=1)
                result["error"] = None
            except Exception as exc:
                result["error"] = (type(exc).__name__, str(exc))
            result["waited"] = time.monotonic() - started
        elif CASE == "late":
            time.sleep(float(os.environ["PADDLE_HYBRID_TIMEOUT"]) + 3)
    result["calls"] = local_p2p.calls()
    save_result(result)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
