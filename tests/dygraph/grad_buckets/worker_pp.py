"""Worker: PP=2 x DP=2 on 4 gloo ranks, fleet's ``pp_configs.delay_scale_loss`` and a GradScaler
(static scale, enabled on CPU), trained twice in this process: stock (the bucket component
uninstalled) and with the plugin's buckets.  The buckets' collective completes only at
``wait()`` (``bucket_fakes.DelayedAllReduce``).

With ``delay_scale_loss`` the pipeline's ``_optimizer_step`` divides every gradient by the
number of microbatches (``p.grad = p.grad.scale(...)``, a new tensor) and the scaler unscales
them, both before the optimizer's ``step()``; both must see the averaged gradients.
"""
import dataclasses
import os
import sys

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

import paddle_hybrid
from paddle_hybrid.testing import save_result

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "cpu"))  # the shared pipeline_models
import pipeline_models as models  # noqa: E402
from bucket_fakes import DelayedAllReduce, cpu_grad_scaler  # noqa: E402

COMPONENT = "grad_buckets"
ACC, MICRO, STEPS, SEED = 4, 2, 3, 7


def train(hcg):
    specs = models.block_specs(8, 8, 16, 4)
    model = models.make_pipeline_layer(specs, SEED, 2, hcg.topology())
    params = models.block_params(model)
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    scaler = cpu_grad_scaler(256.0)
    dp_rank, rows = hcg.get_data_parallel_rank(), ACC * MICRO
    losses = []
    for step in range(STEPS):
        x, y = models.make_data(step, 2 * rows, 8, 4, SEED)
        sl = slice(dp_rank * rows, (dp_rank + 1) * rows)
        loss = model.train_batch([paddle.to_tensor(x[sl]), paddle.to_tensor(y[sl])], opt, scaler=scaler)
        losses.append(float(loss.numpy().reshape(-1)[0]))
    buckets = getattr(model, "_ph_grad_buckets", None)
    return {"params": {k: p.numpy() for k, p in params.items()}, "losses": losses,
            "bucketed": buckets is not None, "stats": buckets.stats() if buckets is not None else None}


def main():
    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 2,
                               "pp_configs": {"delay_scale_loss": True}}
    strategy.pipeline_configs = {"accumulate_steps": ACC, "micro_batch_size": MICRO}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dist.all_reduce = DelayedAllReduce()
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component(COMPONENT)
    try:
        stock = train(hcg)
    finally:
        paddle_hybrid.install_component(COMPONENT, config)
    # several buckets (at most 3 parameters each), to exercise their order
    paddle_hybrid.install_component(COMPONENT, dataclasses.replace(config, grad_bucket_max_params=3))
    buckets = train(hcg)
    paddle_hybrid.install_component(COMPONENT, config)
    save_result({"rank": dist.get_rank(), "stage": hcg.get_stage_id(), "dp_rank": hcg.get_data_parallel_rank(),
                 "stock": stock, "buckets": buckets})


if __name__ == "__main__":
    main()
