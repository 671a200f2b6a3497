"""Worker: a backward that raises mid-pass, then normal steps; data parallel over 2 gloo ranks
(``fleet.distributed_model`` -> DataParallel).

Variants (``W_VARIANTS``, ``<who>-<collective>``): who raises, ``every`` rank or only rank 0
(``one``: rank 1's backward completes and syncs); the buckets' collective ``gloo`` (completes
inside the call: a started bucket is already reduced when the failure comes) or ``delayed``
(completes only at ``wait()``, as NCCL's: ``bucket_fakes.DelayedAllReduce``).

Training with buckets: step 0 normal (the buckets learn that every parameter gets one gradient
per pass, so in step 1 a bucket starts from a hook during backward); step 1: a user hook on the first layer's weight raises after the first bucket
started, the step is skipped (``clear_grad``, no update); steps 2 and 3 normal.  Stock (the
bucket component uninstalled): steps 0, 2 and 3, the same data.  Saved per rank: what the failed
step left behind, the gradients of steps 2 and 3 as backward returns them, the parameters.
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
from bucket_fakes import DelayedAllReduce  # noqa: E402

COMPONENT = "grad_buckets"


def _model():
    paddle.seed(5)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 16),
                                paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _shard(step, rank):
    rng = np.random.default_rng(200 + step)
    x = rng.standard_normal((8, 8)).astype("float32")[rank * 4:(rank + 1) * 4]
    y = rng.standard_normal((8, 4)).astype("float32")[rank * 4:(rank + 1) * 4]
    return paddle.to_tensor(x), paddle.to_tensor(y)


def _backward(model, step, rank):
    x, y = _shard(step, rank)
    paddle.nn.functional.mse_loss(model(x), y).backward()


def _grads(model):
    return {str(i): p.grad.numpy().copy() for i, p in enumerate(model.parameters())}


def _failed_step(model, opt, gb, raises):
    """Step 1: a hook on the first layer's weight (its gradient comes last) raises; returns
    what the failure left behind."""
    started, before = [], gb.stats()["bucket_syncs"]

    def failing_hook(grad):
        started.append(gb.stats()["bucket_syncs"] - before)  # buckets of this pass started so far
        raise ValueError("injected failure in a gradient hook")

    first_weight = model._layers[0].weight
    handle = first_weight.register_hook(failing_hook) if raises else None
    error = None
    try:
        _backward(model, 1, dist.get_rank())
    except Exception as exc:  # Paddle reports the hook's ValueError as an OSError
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if handle is not None:
            handle.remove()
    opt.clear_grad()  # the step is skipped on every rank
    return {"error": error, "started_before_raise": started, "tasks_left": len(gb._tasks),
            "stale_error": repr(gb.error) if gb.error is not None else None, "next_bucket": gb._next,
            "stats": gb.stats()}


def train(with_failure, raises):
    rank = dist.get_rank()
    model = fleet.distributed_model(_model())
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
    gb = getattr(model, "_ph_grad_buckets", None)
    out = {"bucketed": gb is not None, "grads": {}}
    for step in range(4):
        if step == 1:
            if with_failure:
                out["failed"] = _failed_step(model, opt, gb, raises)
            continue
        _backward(model, step, rank)
        out["grads"][step] = _grads(model)
        if gb is not None:
            out.setdefault("views", {})[step] = all(b.is_bound(i) for b in gb.buckets for i in range(len(b.params)))
        opt.step()
        opt.clear_grad()
    out["params"] = {str(i): p.numpy() for i, p in enumerate(model.parameters())}
    return out


def main():
    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    real_all_reduce, delayed = dist.all_reduce, DelayedAllReduce()
    rank = dist.get_rank()
    config = paddle_hybrid.current_config()
    out = {"rank": rank, "variants": {}}
    for name in os.environ.get("W_VARIANTS", "every-gloo,one-gloo,every-delayed,one-delayed").split(","):
        dist.all_reduce = delayed if name.endswith("-delayed") else real_all_reduce
        paddle_hybrid.uninstall_component(COMPONENT)
        try:
            stock = train(with_failure=False, raises=False)
        finally:
            # two buckets of 3 parameters: the first starts before the first layer's hook runs
            paddle_hybrid.install_component(COMPONENT, dataclasses.replace(config, grad_bucket_max_params=3))
        raises = name.startswith("every") or rank == 0
        out["variants"][name] = {"stock": stock, "buckets": train(with_failure=True, raises=raises)}
    paddle_hybrid.install_component(COMPONENT, config)
    save_result(out)


if __name__ == "__main__":
    main()
