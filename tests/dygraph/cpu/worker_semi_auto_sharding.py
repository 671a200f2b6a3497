"""One rank of ``test_semi_auto_sharding.py``: ``dist.shard_optimizer`` with no sharding and with
``ShardingStage1/2/3`` on a data-parallel mesh of every rank, the same model, data and steps
each; prints nothing, saves every run's losses and final parameters.  Run by plain ``python`` it
is the one-process reference (a mesh of one rank)."""
import numpy as np
import paddle
import paddle.distributed as dist

from paddle_hybrid.testing import save_result

STEPS = 3


def train(stage: str, mesh) -> dict:
    paddle.seed(7)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    optimizer = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    if stage != "none":
        optimizer = dist.shard_optimizer(optimizer, getattr(dist, f"ShardingStage{stage}")("dp", mesh))
    data = np.random.RandomState(0)
    losses = []
    for _ in range(STEPS):
        x = dist.shard_tensor(paddle.to_tensor(data.randn(8, 8).astype("float32")), mesh, [dist.Shard(0)])
        y = dist.shard_tensor(paddle.to_tensor(data.randn(8, 4).astype("float32")), mesh, [dist.Shard(0)])
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss.numpy()))
    params = {name: dist.reshard(p, mesh, [dist.Replicate()])._local_value().numpy() if p.is_dist() else p.numpy()
              for name, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def main() -> None:
    dist.init_parallel_env()
    mesh = dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["dp"])
    save_result({"rank": dist.get_rank(), "runs": {stage: train(stage, mesh) for stage in ("none", "1", "2", "3")}})


if __name__ == "__main__":
    main()
