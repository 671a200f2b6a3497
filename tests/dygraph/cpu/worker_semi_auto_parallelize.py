"""One rank of ``test_semi_auto_parallelize.py``: ``dist.parallelize`` of a two-layer MLP in one
layout (``--mode``: ``dp0``..``dp3`` data parallel at a sharding level, ``mp`` column/row tensor
parallel, ``pp`` the layers on two stages, ``mppp`` both on a 2 x 2 mesh, ``one`` no parallelism: the
one-process reference), three AdamW steps on the same data (in data parallel each rank gets its
half of the batch: ``dp3`` through ``dist.shard_dataloader(..., shard_dims="dp")``, which gives
rank r samples [8k + 4r, 8k + 4r + 4) of step k, the others through ``dist.shard_tensor``); saves
the losses this rank sees and every parameter it holds, whole (``name: array``)."""
import argparse

import numpy as np
import paddle
import paddle.distributed as dist

from paddle_hybrid.testing import save_result

STEPS = 3


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.l1 = paddle.nn.Linear(8, 16)
        self.l2 = paddle.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(paddle.nn.functional.relu(self.l1(x)))


def _config(mode: str, nranks: int):
    mp_plan = {"parallelize_plan": {"l1": dist.ColWiseParallel(), "l2": dist.RowWiseParallel()}}
    pp_split = {"split_spec": {"l1": dist.SplitPoint.END}}
    if mode.startswith("dp"):
        return dist.ProcessMesh(list(range(nranks)), dim_names=["dp"]), {"dp_config": {"sharding_level": int(mode[2:])}}
    if mode == "mp":
        return dist.ProcessMesh(list(range(nranks)), dim_names=["mp"]), {"mp_config": mp_plan}
    if mode == "pp":
        return dist.ProcessMesh(list(range(nranks)), dim_names=["pp"]), {"pp_config": pp_split}
    if mode == "mppp":
        return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"]), {"pp_config": pp_split, "mp_config": mp_plan}
    raise ValueError(mode)


def _whole(param):
    """The whole value of a parameter this rank holds (None if it holds none)."""
    if not param.is_dist():
        return param.numpy()
    whole = dist.reshard(param, param.process_mesh, [dist.Replicate()] * len(param.placements))
    return whole._local_value().numpy() if whole._is_initialized() else None


def _batches(mode: str, mesh):
    """The same 3 batches of 8 in every mode (in data parallel each rank gets its half)."""
    data = np.random.RandomState(0)
    pairs = [(data.randn(8, 8).astype("float32"), data.randn(8, 4).astype("float32")) for _ in range(STEPS)]
    if mode == "dp3":
        samples = [(x[i], y[i]) for x, y in pairs for i in range(8)]
        loader = paddle.io.DataLoader(samples, batch_size=8, shuffle=False)
        yield from (tuple(batch) for batch in dist.shard_dataloader(loader, meshes=mesh, shard_dims="dp"))
        return
    for x, y in pairs:
        x, y = paddle.to_tensor(x), paddle.to_tensor(y)
        if mode.startswith("dp"):
            x, y = (dist.shard_tensor(t, mesh, [dist.Shard(0)]) for t in (x, y))
        yield x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    args = parser.parse_args()
    if args.mode != "one":
        dist.init_parallel_env()
    paddle.seed(7)
    model = MLP()
    optimizer = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    if args.mode != "one":
        mesh, config = _config(args.mode, dist.get_world_size())
        dist.auto_parallel.set_mesh(mesh)
        model, optimizer = dist.parallelize(model, optimizer, config=config)
    losses = []
    for x, y in _batches(args.mode, mesh if args.mode != "one" else None):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss.numpy()) if loss._is_initialized() else None)
    params = {name: _whole(p) for name, p in model.named_parameters()}
    save_result({"rank": dist.get_rank() if args.mode != "one" else 0, "losses": losses,
                 "params": {k: v for k, v in params.items() if v is not None}})


if __name__ == "__main__":
    main()
