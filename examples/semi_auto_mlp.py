"""Train a stack of MLP blocks with Paddle 3's semi-auto API on a (pp, dp, mp) process mesh.

``dist.parallelize`` does the layout: the blocks split over ``--pp`` pipeline stages (each stage's
blocks on its own sub-mesh; activations cross meshes by reshard), each block's first linear
column-parallel and its second row-parallel over ``--mp`` (the row-parallel output is Partial and
reshards to Replicate: an all_reduce), and every batch sharded over ``--dp`` (the gradients of a
replicated weight become Partial over dp and are reduced).  On CPU every reshard runs on the plugin's
gloo kernels; in a dry run (``python -m paddle_hybrid.dryrun``) on its fake comm contexts.

    python -m paddle_hybrid.launch --nproc_per_node 8 examples/semi_auto_mlp.py --pp 2 --dp 2 --mp 2

Prints each step's loss on the last stage; ``--out FILE`` writes the losses as JSON.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import paddle
import paddle.distributed as dist


class Block(paddle.nn.Layer):
    """hidden -> 4 x hidden -> hidden, GELU between, a residual around."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = paddle.nn.Linear(hidden, 4 * hidden)
        self.fc2 = paddle.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))


class Model(paddle.nn.Layer):
    def __init__(self, layers: int, hidden: int):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(hidden) for _ in range(layers)])
        self.head = paddle.nn.Linear(hidden, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--mp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (divided over dp)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the losses here as JSON")
    args = parser.parse_args(argv)
    _check(args)
    return args


def _check(args) -> None:
    """Degrees the model cannot take, named before anything runs."""
    problems = []
    if args.layers % args.pp:
        problems.append(f"--layers {args.layers} over --pp {args.pp}: each stage needs whole blocks")
    if (4 * args.hidden) % args.mp or args.hidden % args.mp:
        problems.append(f"--hidden {args.hidden} (and its 4x) over --mp {args.mp}: each rank needs whole columns")
    if args.batch_size % args.dp:
        problems.append(f"--batch-size {args.batch_size} over --dp {args.dp}")
    if problems:
        raise SystemExit("semi_auto_mlp: " + "; ".join(problems) + ". Choose degrees that divide.")


def _plan(args):
    """dist.parallelize's config: column/row-parallel pairs over mp, a split after each stage's blocks."""
    config = {"dp_config": {"sharding_level": 0}}
    if args.mp > 1:
        plan = {}
        for i in range(args.layers):
            plan[f"blocks.{i}.fc1"] = dist.ColWiseParallel()
            plan[f"blocks.{i}.fc2"] = dist.RowWiseParallel()
        config["mp_config"] = {"parallelize_plan": plan}
    if args.pp > 1:
        per_stage = args.layers // args.pp
        config["pp_config"] = {"split_spec": {f"blocks.{(s + 1) * per_stage - 1}": dist.SplitPoint.END
                                              for s in range(args.pp - 1)}}
    return config


def _batches(args, mesh):
    """The same batches whatever the layout: x on the first stage, y on the last, both sharded over dp."""
    data = np.random.RandomState(0)
    first, last = mesh.get_mesh_with_dim("pp")[0], mesh.get_mesh_with_dim("pp")[-1]
    placements = [dist.Shard(0), dist.Replicate()]
    for _ in range(args.steps):
        x = paddle.to_tensor(data.randn(args.batch_size, args.hidden).astype("float32"))
        y = paddle.to_tensor(data.randn(args.batch_size, 1).astype("float32"))
        yield dist.shard_tensor(x, first, placements), dist.shard_tensor(y, last, placements)


def main(argv=None):
    args = _parse(argv)
    dist.init_parallel_env()
    mesh = dist.ProcessMesh(np.arange(args.pp * args.dp * args.mp).reshape(args.pp, args.dp, args.mp).tolist(),
                            dim_names=["pp", "dp", "mp"])
    dist.auto_parallel.set_mesh(mesh)
    paddle.seed(1234)
    model = Model(args.layers, args.hidden)
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    model, optimizer = dist.parallelize(model, optimizer, config=_plan(args))
    losses = []
    for step, (x, y) in enumerate(_batches(args, mesh)):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        if loss._is_initialized():
            losses.append(float(loss.numpy()))
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    if args.out and losses:
        with open(args.out, "w") as f:
            json.dump({"rank": dist.get_rank(), "losses": losses}, f)


if __name__ == "__main__":
    main()
