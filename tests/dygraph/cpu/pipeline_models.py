"""A small pipeline model, its single-process reference, and a worker that trains it
with fleet hybrid parallel on N gloo ranks.  Shared by the tests of hybrid parallel on
CPU, of the gradient buckets, and by anyone who needs a known-good pipeline run.

Model: ``num_layers`` :class:`DenseBlock` (Linear + tanh, the last without tanh)
whose weights come from NumPy seeded by ``(seed, layer index)``, so a
``PipelineLayer`` split over any number of stages and a plain ``Sequential``
start from the same values.  Loss: mean squared error.  Optimizer: SGD.

Worker (run through :func:`paddle_hybrid.testing.launch`)::

    launch("tests/dygraph/cpu/pipeline_models.py", nprocs=3,
           args=["--pp", "3", "--acc", "6", "--variants", "vpp=1;vpp=2"])

Each rank saves ``{"rank", "stage", "dp_rank", "variants": {spec: result}}``
where a result has ``losses`` (this rank's ``train_batch`` losses),
``ref_losses`` (the single-process reference's loss on this rank's data
shard, same steps), ``params`` (``"<layer>.w"``/``"<layer>.b"`` -> array after
training, this rank's layers only), ``ref_params`` (the reference's values for
the same keys), ``bucket_stats`` (or None) and ``model_class``.

A variant spec is ``key=value`` pairs joined by ``,``; variants are separated
by ``;`` and run one after another in the same process (same fleet
topology), each with a fresh model and optimizer.  Keys: ``vpp`` (virtual
stages per rank, default 1), ``batch_p2p`` (0/1, default 0),
``fuse`` (``strategy.fuse_all_reduce_ops``, 0/1, default 1), ``fuse_mb``
(``strategy.fuse_grad_size_in_MB``, default 32), ``sync`` (plain DP only:
``model`` = fleet's own path, ``per_param`` = one all_reduce per gradient after
backward, ``fused_allreduce`` = Paddle's ``fused_allreduce_gradients``; default
``model``), ``clear`` (``zero`` or ``none``: how ``clear_grad`` is called;
default ``zero``), ``die_rank`` / ``die_step`` (that rank calls ``os._exit(0)``
during backward of that step, to test that the others fail rather than hang),
``skew`` (1: rank 1 builds one layer wider, a layout mismatch), ``max_params``
(rebuild the buckets with at most this many parameters each).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

__all__ = [
    "DenseBlock",
    "block_specs",
    "make_pipeline_layer",
    "make_sequential",
    "make_data",
    "parse_variant",
    "reference_run",
    "main",
]


def block_specs(num_layers, in_dim, hidden, out_dim):
    """(in, out, act) of every block."""
    dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
    return [(dims[i], dims[i + 1], i < num_layers - 1) for i in range(num_layers)]


def _block_class():
    import paddle

    class DenseBlock(paddle.nn.Layer):
        """Linear (+ tanh) with weights from ``np.random.default_rng((seed, index))``."""

        def __init__(self, in_dim, out_dim, act, index, seed):
            super().__init__()
            self.index = index
            self.act = act
            self.linear = paddle.nn.Linear(in_dim, out_dim)
            rng = np.random.default_rng((seed, index))
            w = (rng.standard_normal((in_dim, out_dim)) / np.sqrt(in_dim)).astype("float32")
            b = (0.1 * rng.standard_normal((out_dim,))).astype("float32")
            self.linear.weight.set_value(w)
            self.linear.bias.set_value(b)

        def forward(self, x):
            y = self.linear(x)
            return paddle.tanh(y) if self.act else y

    return DenseBlock


_DENSE_BLOCK = None


def __getattr__(name):  # DenseBlock is built lazily so importing this module needs no paddle
    global _DENSE_BLOCK
    if name == "DenseBlock":
        if _DENSE_BLOCK is None:
            _DENSE_BLOCK = _block_class()
        return _DENSE_BLOCK
    raise AttributeError(name)


def make_pipeline_layer(specs, seed, num_stages, topology, vpp=1):
    """A ``PipelineLayer`` of the blocks (split evenly by DenseBlock) with an MSE loss."""
    import paddle
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    block = __getattr__("DenseBlock")
    descs = [LayerDesc(block, i_d, o_d, act, idx, seed) for idx, (i_d, o_d, act) in enumerate(specs)]
    kwargs = {}
    if vpp > 1:
        kwargs["num_virtual_pipeline_stages"] = vpp
    return PipelineLayer(layers=descs, num_stages=num_stages, loss_fn=paddle.nn.MSELoss(),
                         topology=topology, seg_method="layer:DenseBlock", **kwargs)


def make_sequential(specs, seed):
    import paddle

    block = __getattr__("DenseBlock")
    return paddle.nn.Sequential(*[block(i_d, o_d, act, idx, seed) for idx, (i_d, o_d, act) in enumerate(specs)])


def make_data(step, batch, in_dim, out_dim, seed):
    """Global batch of step ``step`` (NumPy, float32)."""
    rng = np.random.default_rng((seed, 1000 + step))
    x = rng.standard_normal((batch, in_dim)).astype("float32")
    y = rng.standard_normal((batch, out_dim)).astype("float32")
    return x, y


def block_params(layer):
    """``{"<index>.w": weight, "<index>.b": bias}`` of every DenseBlock inside ``layer``."""
    block = __getattr__("DenseBlock")
    out = {}
    for sub in layer.sublayers(include_self=True):
        if isinstance(sub, block):
            out[f"{sub.index}.w"] = sub.linear.weight
            out[f"{sub.index}.b"] = sub.linear.bias
    return out


def reference_run(specs, seed, steps, batch, micro, lr, in_dim, out_dim, dp, dp_rank):
    """Single process, same model and data: per step the loss of the microbatches of
    DP shard ``dp_rank`` (as ``train_batch`` reports it), gradient = mean over all
    microbatches of the global batch; returns (losses, {key: array})."""
    import paddle

    model = make_sequential(specs, seed)
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())
    mse = paddle.nn.MSELoss()
    n_micro = batch // micro
    per_shard = n_micro // dp
    losses = []
    for step in range(steps):
        x, y = make_data(step, batch, in_dim, out_dim, seed)
        shard = []
        for m in range(n_micro):
            sl = slice(m * micro, (m + 1) * micro)
            loss = mse(model(paddle.to_tensor(x[sl])), paddle.to_tensor(y[sl]))
            (loss / n_micro).backward()
            if m // per_shard == dp_rank:
                shard.append(float(loss))
        losses.append(float(np.mean(shard)))
        opt.step()
        opt.clear_grad()
    return losses, {k: v.numpy() for k, v in block_params(model).items()}


def parse_variant(spec):
    out = {"vpp": 1, "batch_p2p": 0, "fuse": 1, "fuse_mb": 32, "sync": "model", "clear": "zero",
           "die_rank": -1, "die_step": -1, "skew": 0, "max_params": 0}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        if key not in out:
            raise ValueError(f"models: unknown variant key {key!r} in {spec!r}; known: {sorted(out)}.")
        out[key] = type(out[key])(value) if not isinstance(out[key], str) else value
    return out


def _run_variant(args, v, hcg, strategy):
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from paddle_hybrid.dygraph import grad_buckets

    rank = dist.get_rank()
    dp_rank = hcg.get_data_parallel_rank()
    # data-parallel and segment-parallel ranks each take their own rows of the batch
    replicas = args.dp * args.sep
    replica = dp_rank * args.sep + hcg.get_sep_parallel_rank()
    stage = hcg.get_stage_id()
    specs = block_specs(args.layers, args.in_dim, args.hidden, args.out_dim)
    if v["skew"] and rank == 1:
        i_d, o_d, act = specs[0]
        specs = [(i_d, o_d + 1, act), (o_d + 1,) + specs[1][1:]] + specs[2:]

    strategy.strategy.hybrid_configs.pp_configs.use_batch_p2p_comm = bool(v["batch_p2p"])
    # Another sync than fleet's own replaces it: no buckets, no DataParallel reducer.
    strategy.fuse_all_reduce_ops = bool(v["fuse"]) and v["sync"] == "model"
    strategy.fuse_grad_size_in_MB = int(v["fuse_mb"])

    if args.pp > 1:
        model = make_pipeline_layer(specs, args.seed, args.pp, hcg.topology(), vpp=v["vpp"])
    else:
        model = make_sequential(specs, args.seed)
    params = block_params(model)
    opt = paddle.optimizer.SGD(learning_rate=args.lr, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    if v["sync"] != "model" and hasattr(model, "grad_need_sync"):
        model.grad_need_sync = False  # paddle.DataParallel's reducer off
    buckets = grad_buckets.buckets_of(model)
    if buckets is not None and v["max_params"]:
        # Rebuild with a count limit, to get many small buckets out of a small model.
        buckets.remove()
        from paddle_hybrid.dygraph.grad_buckets import attach_buckets

        buckets = attach_buckets(model, strategy, hcg, max_params=v["max_params"])

    mse = paddle.nn.MSELoss()
    shard_rows = args.batch // replicas
    losses = []
    for step in range(args.steps):
        if step == v["die_step"] and rank == v["die_rank"]:
            # Die in the middle of backward, after the first gradient is final.
            first = next(iter(params.values()))
            first._register_backward_hook(lambda *a: os._exit(0))
        x, y = make_data(step, args.batch, args.in_dim, args.out_dim, args.seed)
        sl = slice(replica * shard_rows, (replica + 1) * shard_rows)
        xs, ys = paddle.to_tensor(x[sl]), paddle.to_tensor(y[sl])
        if args.pp > 1:
            loss = model.train_batch([xs, ys], opt)
            losses.append(float(np.asarray(loss.numpy()).reshape(-1)[0]))
            continue
        # Plain DP (or one process): the microbatches of this shard, accumulated.
        n_micro = shard_rows // args.micro
        total = 0.0
        for m in range(n_micro):
            ms = slice(m * args.micro, (m + 1) * args.micro)
            last = m == n_micro - 1
            ctx = model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
            with ctx:
                mloss = mse(model(xs[ms]), ys[ms])
                # fleet sums segment-parallel gradients: a segment's loss is its share
                # of the sample's loss, so each segment rank weighs its mean by 1/sep
                (mloss / n_micro / args.sep).backward()
            total += float(mloss)
        losses.append(total / n_micro)
        if v["sync"] == "per_param":
            with paddle.no_grad():
                for p in model.parameters():
                    p.grad.scale_(1.0 / args.dp)
                    dist.all_reduce(p.grad, group=hcg.get_data_parallel_group())
        elif v["sync"] == "fused_allreduce":
            from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

            fused_allreduce_gradients(list(model.parameters()), hcg)
        opt.step()
        opt.clear_grad(set_to_zero=(v["clear"] == "zero"))

    ref_losses, ref_params = reference_run(specs, args.seed, args.steps, args.batch, args.micro, args.lr,
                                           args.in_dim, args.out_dim, replicas, replica)
    got = {k: p.numpy() for k, p in params.items()}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": got,
        "ref_params": {k: ref_params[k] for k in got},
        "bucket_stats": buckets.stats() if buckets is not None else None,
        "model_class": type(model).__name__,
        "stage": stage,
        "replica": replica,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train the test pipeline model with fleet on gloo ranks.")
    parser.add_argument("--pp", type=int, default=1, help="pipeline degree")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    parser.add_argument("--sep", type=int, default=1, help="segment-parallel degree (each rank its own rows)")
    parser.add_argument("--acc", type=int, default=4, help="microbatches per step per DP rank")
    parser.add_argument("--micro", type=int, default=2, help="microbatch size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--in-dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--out-dim", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--variants", default="", help="variant specs separated by ';' (see module doc)")
    args = parser.parse_args(argv)
    args.batch = args.micro * args.acc * args.dp * args.sep

    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (before fleet.init)
    from paddle.distributed import fleet

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": 1, "pp_degree": args.pp, "sep_degree": args.sep}
    strategy.pipeline_configs = {"accumulate_steps": args.acc, "micro_batch_size": args.micro}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    strategy = fleet.fleet._user_defined_strategy

    out = {"rank": dist.get_rank(), "stage": hcg.get_stage_id(), "dp_rank": hcg.get_data_parallel_rank(),
           "variants": {}}
    for spec in (args.variants.split(";") if args.variants else [""]):
        out["variants"][spec] = _run_variant(args, parse_variant(spec), hcg, strategy)

    from paddle_hybrid.testing import save_result

    save_result(out)


if __name__ == "__main__":
    sys.exit(main())
