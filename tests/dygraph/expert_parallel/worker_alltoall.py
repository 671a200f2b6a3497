"""Every all-to-all form on gloo, with values that name their sender, receiver and row.

Rank ``r`` sends rank ``p`` the rows ``code(r, p, k) = 1000 r + 10 p + k``; the test checks
what arrived against that rule.  Unequal splits: ``r`` sends ``p`` ``(r + 2 p) % 3`` rows, so
some parts are empty.  Also run on a 2-rank subgroup (ranks 0 and 2 of 4, ranks 1 and 3) to
check that group-local ranks are used.
"""
import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401
from paddle_hybrid.testing import save_result


def code(r, p, rows, width=2):
    return np.array([[1000 * r + 10 * p + k] * width for k in range(rows)], dtype="float32").reshape(rows, width)


def unequal(r, p):
    return (r + 2 * p) % 3


def forms(group, ranks):
    """Each form on ``group`` (global ranks ``ranks``); results keyed by form."""
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    out = {}
    # equal splits, dist.alltoall_single, synchronous
    x = paddle.to_tensor(np.concatenate([code(me, p, 3) for p in range(n)]))
    y = paddle.empty_like(x)
    dist.alltoall_single(y, x, group=group)
    out["single_equal"] = y.numpy()
    # unequal splits with empty parts, asynchronous + wait()
    ins = [unequal(me, p) for p in range(n)]
    outs = [unequal(p, me) for p in range(n)]
    x = paddle.to_tensor(np.concatenate([code(me, p, ins[p]) for p in range(n)]))
    y = paddle.empty([sum(outs), 2], dtype="float32")
    task = dist.alltoall_single(y, x, in_split_sizes=ins, out_split_sizes=outs, group=group, sync_op=False)
    task.wait()
    out["single_unequal_async"] = y.numpy()
    # the stream API
    y2 = paddle.empty([sum(outs), 2], dtype="float32")
    dist.stream.alltoall_single(y2, x, out_split_sizes=outs, in_split_sizes=ins, group=group)
    out["stream_single_unequal"] = y2.numpy()
    # list form, each peer its own shape (empty ones included): outputs sized by the caller
    got = [paddle.empty([outs[p], 2], dtype="float32") for p in range(n)]
    dist.alltoall(got, [paddle.to_tensor(code(me, p, ins[p])) for p in range(n)], group=group)
    out["list"] = [t.numpy() for t in got]
    # list form with an empty output list: Paddle sizes the outputs like the inputs (equal parts)
    got = []
    dist.alltoall(got, [paddle.to_tensor(code(me, p, 1)) for p in range(n)], group=group)
    out["list_equal"] = [t.numpy() for t in got]
    # tensor form through the stream API (equal parts)
    x = paddle.to_tensor(np.concatenate([code(me, p, 2) for p in range(n)]))
    y = paddle.empty_like(x)
    dist.stream.alltoall(y, x, group=group)
    out["stream_tensor"] = y.numpy()
    # the legacy process-group method MoELayer.count_by_gate calls (input first), int64
    counts = paddle.to_tensor(np.array([100 * me + p for p in range(n)], dtype="int64"))
    received = paddle.empty([n], dtype="int64")
    group.process_group.alltoall(counts, received).wait()
    out["legacy_alltoall_int64"] = received.numpy()
    return out


def main():
    dist.init_parallel_env()
    world = dist.get_world_size()
    result = {"global": forms(dist.collective._get_global_group(), list(range(world)))}
    if world == 4:
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = pairs[dist.get_rank() % 2]
        result["subgroup"] = forms(mine, [0, 2] if dist.get_rank() % 2 == 0 else [1, 3])
    from paddle_hybrid.gloo import kernels

    result["native_calls"] = kernels.calls("AllToAllV")  # the C++ exchange moved the bytes
    save_result(result)


if __name__ == "__main__":
    main()
