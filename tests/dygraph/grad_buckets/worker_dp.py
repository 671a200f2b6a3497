"""Worker: data parallel over 2 gloo ranks (``fleet.distributed_model`` -> DataParallel),
every variant trained twice in this process, once stock (the bucket component uninstalled)
and once with the plugin's buckets, on the same data; the buckets' collective completes only
at ``wait()`` (``bucket_fakes.DelayedAllReduce``; Paddle's own paths are synchronous and run
unchanged).  Variants (``W_VARIANTS``, comma separated):

* ``amp``: GradScaler (static scale, enabled on CPU) + global-norm clipping; at step 1 rank 1's
  batch holds an inf, so the averaged gradient is inf on both ranks and both must skip.
* ``main_grad``: MixPrecisionLayer + MixPrecisionOptimizer (fp32 ``main_grad``).  Stock syncs
  ``main_grad`` the way fleet's recipe does it in pure DP: ``no_sync()`` + ``fused_allreduce_gradients``.
* ``uninstall``: buckets for 2 steps, ``uninstall_component``, 2 more steps (checks the model got
  its reducer back and no bucket code runs); stock: 4 steps.
"""
import dataclasses
import os
import sys

import numpy as np

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

import paddle_hybrid
from paddle_hybrid.testing import save_result

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bucket_fakes import DelayedAllReduce, bucket_code_calls, cpu_grad_scaler  # noqa: E402

COMPONENT = "grad_buckets"


def _model():
    paddle.seed(3)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 16),
                                paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _shard(step, rank, inf=False):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((8, 8)).astype("float32")[rank * 4:(rank + 1) * 4]
    y = rng.standard_normal((8, 4)).astype("float32")[rank * 4:(rank + 1) * 4]
    if inf:
        x[0, 0] = np.inf
    return paddle.to_tensor(x), paddle.to_tensor(y)


def _params(model):
    return {str(i): p.numpy() for i, p in enumerate(model.parameters())}


def _bucketed(model):
    return getattr(model, "_ph_grad_buckets", None) is not None


def run_amp(stock):
    rank = dist.get_rank()
    model = fleet.distributed_model(_model())
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters(),
                                                           grad_clip=paddle.nn.ClipGradByGlobalNorm(5.0)))
    scaler = cpu_grad_scaler()
    skipped = []
    for step in range(3):
        x, y = _shard(step, rank, inf=(step == 1 and rank == 1))
        scaler.scale(paddle.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler._cache_found_inf))
        opt.clear_grad()
    return {"params": _params(model), "skipped": skipped, "bucketed": _bucketed(model)}


def run_main_grad(stock):
    from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer

    rank, hcg = dist.get_rank(), fleet.get_hybrid_communicate_group()
    inner = MixPrecisionLayer(_model(), dtype="bfloat16")
    model = fleet.distributed_model(inner)
    opt = fleet.distributed_optimizer(MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=inner.parameters())))
    for step in range(3):
        x, y = _shard(step, rank)
        if stock:
            with model.no_sync():
                paddle.nn.functional.mse_loss(model(x), y).backward()
            fused_allreduce_gradients(list(inner.parameters()), hcg)
        else:
            paddle.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    return {"params": _params(model), "bucketed": _bucketed(model),
            "grad_none": all(p.grad is None for p in inner.parameters()),
            "main_grad_fp32": all(p.main_grad.dtype == paddle.float32 for p in inner.parameters())}


def _train_steps(model, opt, steps, rank):
    for step in steps:
        x, y = _shard(step, rank)
        paddle.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.clear_grad()


def run_uninstall(stock):
    rank = dist.get_rank()
    model = fleet.distributed_model(_model())
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
    if stock:
        _train_steps(model, opt, range(4), rank)
        return {"params": _params(model), "bucketed": _bucketed(model)}
    bucketed = _bucketed(model)
    _train_steps(model, opt, range(2), rank)
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component(COMPONENT)
    try:
        restored = {"grad_need_sync": model.grad_need_sync is True, "no_sync": "no_sync" not in vars(model),
                    "detached": not _bucketed(model)}
        calls = bucket_code_calls(lambda: _train_steps(model, opt, range(2, 4), rank))
    finally:
        paddle_hybrid.install_component(COMPONENT, config)
    return {"params": _params(model), "bucketed": bucketed, "restored": restored, "calls_after": calls}


def main():
    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    dist.all_reduce = DelayedAllReduce()
    out = {"rank": dist.get_rank(), "variants": {}}
    config = paddle_hybrid.current_config()
    several = dataclasses.replace(config, grad_bucket_max_params=3)  # several buckets: their order matters
    for name in os.environ.get("W_VARIANTS", "amp,main_grad,uninstall").split(","):
        run = globals()[f"run_{name}"]
        paddle_hybrid.uninstall_component(COMPONENT)
        try:
            stock = run(stock=True)
        finally:
            paddle_hybrid.install_component(COMPONENT, several)
        out["variants"][name] = {"stock": stock, "buckets": run(stock=False)}
    paddle_hybrid.install_component(COMPONENT, config)
    save_result(out)


if __name__ == "__main__":
    main()
