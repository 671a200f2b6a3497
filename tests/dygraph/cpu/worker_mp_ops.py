"""Worker: every tensor-parallel op the CPU support replaces, forward and backward on the
gloo ranks of one model-parallel group (all the processes launched: 2 or 4), next to the
same computation done by this process alone on full tensors.

Saves ``{op name: {"got": {...}, "want": {...}}}`` per rank; the test compares them.
"""
import numpy as np

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

import paddle_hybrid  # noqa: F401  (before fleet.init)
from paddle.distributed import fleet
from paddle.distributed.fleet.layers.mpu import mp_ops
from paddle.distributed.fleet.utils import hybrid_parallel_util

from paddle_hybrid.testing import save_result


def leaf(array):
    t = paddle.to_tensor(array)
    t.stop_gradient = False
    return t


def rng(*key):
    return np.random.default_rng((123,) + key)


def check_identity(group, rank, n, skip_forward=False):
    # forward: a copy; backward: the sum over ranks of every rank's output gradient.
    # skip_c_identity_dynamic (mp_skip_c_identity) skips only the forward kernel: the
    # backward must still sum, as Paddle's c_identity_eager does.
    x = rng(1).standard_normal((3, 4)).astype("float32")
    coef = [rng(2, r).standard_normal((3, 4)).astype("float32") for r in range(n)]
    xt = leaf(x)
    y = mp_ops._c_identity(xt, group=group, skip_c_identity_dynamic=skip_forward)
    (y * paddle.to_tensor(coef[rank])).sum().backward()
    return {"got": {"y": y.numpy(), "dx": xt.grad.numpy()}, "want": {"y": x, "dx": sum(coef)}}


def check_mp_allreduce(group, rank, n):
    # forward: the sum over ranks; backward: the output gradient unchanged
    xs = [rng(3, r).standard_normal((2, 5)).astype("float32") for r in range(n)]
    coef = rng(4).standard_normal((2, 5)).astype("float32")
    xt = leaf(xs[rank])
    y = mp_ops._mp_allreduce(xt, group=group)
    (y * paddle.to_tensor(coef)).sum().backward()
    return {"got": {"y": y.numpy(), "dx": xt.grad.numpy()}, "want": {"y": sum(xs), "dx": coef}}


def check_split(group, rank, n):
    # forward: this rank's slice of the last dim; backward: every rank's slice gradient, gathered
    x = rng(5).standard_normal((2, 3, 4 * n)).astype("float32")
    coef = rng(6).standard_normal((2, 3, 4 * n)).astype("float32")
    xt = leaf(x)
    y = mp_ops._c_split(xt, group=group)
    (y * paddle.to_tensor(np.split(coef, n, axis=-1)[rank])).sum().backward()
    return {"got": {"y": y.numpy(), "dx": xt.grad.numpy()},
            "want": {"y": np.split(x, n, axis=-1)[rank], "dx": coef}}


def check_concat(group, rank, n):
    # forward: every rank's tensor joined on the last dim; backward: this rank's slice
    xs = [rng(7, r).standard_normal((3, 2)).astype("float32") for r in range(n)]
    coef = rng(8).standard_normal((3, 2 * n)).astype("float32")
    xt = leaf(xs[rank])
    y = mp_ops._c_concat(xt, group=group)
    (y * paddle.to_tensor(coef)).sum().backward()
    return {"got": {"y": y.numpy(), "dx": xt.grad.numpy()},
            "want": {"y": np.concatenate(xs, axis=-1), "dx": np.split(coef, n, axis=-1)[rank]}}


def check_cross_entropy(group, rank, n, label_rank):
    vocab = 5 * n
    logits = (3 * rng(9).standard_normal((2, 3, vocab))).astype("float32")
    labels = rng(10).integers(0, vocab, size=(2, 3) + ((1,) if label_rank == 3 else ())).astype("int64")
    labels.reshape(-1)[[1, 4]] = -100  # two ignored tokens
    weight = rng(11).standard_normal((2, 3, 1)).astype("float32")

    local = leaf(np.split(logits, n, axis=-1)[rank])
    loss, softmax = mp_ops._c_softmax_with_cross_entropy(local, paddle.to_tensor(labels), group=group,
                                                          return_softmax=True)
    (loss * paddle.to_tensor(weight)).sum().backward()

    full = leaf(logits)
    lbl = paddle.to_tensor(labels if label_rank == 3 else labels[..., None])
    ref = F.cross_entropy(full, lbl, reduction="none", ignore_index=-100)
    (ref * paddle.to_tensor(weight)).sum().backward()
    return {"got": {"loss": loss.numpy(), "softmax": softmax.numpy(), "dlogits": local.grad.numpy()},
            "want": {"loss": ref.numpy(), "softmax": np.split(F.softmax(paddle.to_tensor(logits)).numpy(), n,
                                                               axis=-1)[rank],
                     "dlogits": np.split(full.grad.numpy(), n, axis=-1)[rank]}}


def check_broadcast_input(hcg, rank):
    # rank 1 starts with other values and another shape; both end with rank 0's
    a = paddle.to_tensor(np.full((2, 3), 7.0 if rank == 0 else -1.0, dtype="float32"))
    b = paddle.to_tensor(np.arange(4 if rank == 0 else 6, dtype="int64"))
    nested = {"k": [paddle.to_tensor(np.float32(rank))]}
    hybrid_parallel_util.broadcast_input_data(hcg, a, b, extra=nested)
    return {"got": {"a": a.numpy(), "b": b.numpy(), "k": nested["k"][0].numpy()},
            "want": {"a": np.full((2, 3), 7.0, "float32"), "b": np.arange(4), "k": np.float32(0)}}


def check_reduce_scatter(group, rank, n):
    # gloo has no reduce_scatter; both forms of dist.reduce_scatter must still be right: a sum and
    # an average through the plugin's kernel (counted), a max through all_reduce and a slice
    from paddle_hybrid.gloo import kernels

    xs = [rng(12, r).standard_normal((2 * n, 3)).astype("float32") for r in range(n)]
    total = sum(xs)
    out_t, out_l, out_avg, out_max = (paddle.zeros([2, 3]) for _ in range(4))
    before = kernels.calls("ReduceScatterKernel")
    dist.reduce_scatter(out_t, paddle.to_tensor(xs[rank]), group=group)
    dist.reduce_scatter(out_l, list(paddle.split(paddle.to_tensor(xs[rank]), n)), group=group)
    # (dist.reduce_scatter asks a CPU build for its NCCL version before an average: the stream form)
    dist.stream.reduce_scatter(out_avg, paddle.to_tensor(xs[rank]), op=dist.ReduceOp.AVG, group=group)
    through_kernel = kernels.calls("ReduceScatterKernel") - before
    dist.reduce_scatter(out_max, paddle.to_tensor(xs[rank]), op=dist.ReduceOp.MAX, group=group)
    rows = slice(2 * rank, 2 * rank + 2)
    return {"got": {"tensor_form": out_t.numpy(), "list_form": out_l.numpy(), "average": out_avg.numpy(),
                    "max": out_max.numpy(), "through the kernel": through_kernel},
            "want": {"tensor_form": total[rows], "list_form": total[rows], "average": total[rows] / n,
                     "max": np.max(xs, axis=0)[rows], "through the kernel": 3}}


def main():
    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    n = dist.get_world_size()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": n, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    group, rank = hcg.get_model_parallel_group(), hcg.get_model_parallel_rank()
    out = {
        "_c_identity": check_identity(group, rank, n),
        "_c_identity[skip_c_identity_dynamic]": check_identity(group, rank, n, skip_forward=True),
        "_mp_allreduce": check_mp_allreduce(group, rank, n),
        "_c_split": check_split(group, rank, n),
        "_c_concat": check_concat(group, rank, n),
        "_c_softmax_with_cross_entropy[label b,s]": check_cross_entropy(group, rank, n, 2),
        "_c_softmax_with_cross_entropy[label b,s,1]": check_cross_entropy(group, rank, n, 3),
        "broadcast_input_data": check_broadcast_input(hcg, rank),
        "reduce_scatter": check_reduce_scatter(group, rank, n),
    }
    save_result({"rank": dist.get_rank(), "checks": out})


if __name__ == "__main__":
    main()
