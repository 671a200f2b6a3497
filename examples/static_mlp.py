"""Train a stack of MLP blocks with ``dist.to_static`` (a static program) on a (pp, dp, mp) process mesh.

Each block's first linear is column-parallel and its second row-parallel over ``--mp``; the batch is
split over ``--dp``; with ``--sharding-stage 1|2|3`` the optimizer (AdamW) is ``dist.shard_optimizer``'s
over the dp axis; with ``--pp`` the blocks split over pipeline stages (each stage's blocks on its own
sub-mesh) and the program runs ``--schedule`` (1F1B, FThenB) over ``--accumulate-steps`` microbatches.
On CPU the plugin runs the program's collectives on gloo; in a dry run (``python -m paddle_hybrid.dryrun``)
on its fake comm contexts.

    python -m paddle_hybrid.launch --nproc_per_node 8 examples/static_mlp.py --pp 2 --dp 2 --mp 2
    python -m paddle_hybrid.dryrun --nnodes 16 --nproc_per_node 8 examples/static_mlp.py --pp 4 --dp 4 --mp 8

Prints each step's loss where the last stage has it; ``--out FILE`` writes this rank's losses as JSON.
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
    """The blocks, each on its stage's mesh; activations cross stages by reshard."""

    def __init__(self, args, stage_meshes):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(args.hidden) for _ in range(args.layers)])
        self.head = paddle.nn.Linear(args.hidden, 1)
        per_stage = args.layers // args.pp
        self.meshes = [stage_meshes[i // per_stage] for i in range(args.layers)] + [stage_meshes[-1]]
        r, s0, s1 = dist.Replicate(), dist.Shard(0), dist.Shard(1)
        for block, mesh in zip(self.blocks, self.meshes):  # column- then row-parallel over mp
            _shard(block.fc1, mesh, [r, s1], [r, s0])
            _shard(block.fc2, mesh, [r, s0], [r, r])
        _shard(self.head, stage_meshes[-1], [r, r], [r, r])

    def forward(self, x):
        for block, mesh in zip(self.blocks, self.meshes):
            if x.process_mesh != mesh:
                x = dist.reshard(x, mesh, [dist.Shard(0), dist.Replicate()])
            x = block(x)
        return self.head(x)


def _shard(linear, mesh, weight, bias) -> None:
    linear.weight = dist.shard_tensor(linear.weight, mesh, weight)
    linear.bias = dist.shard_tensor(linear.bias, mesh, bias)


class Data(paddle.io.Dataset):
    """The same samples whatever the layout."""

    def __init__(self, args):
        rng = np.random.RandomState(0)
        n = args.batch_size * args.steps
        self.x = rng.randn(n, args.hidden).astype("float32")
        self.y = rng.randn(n, 1).astype("float32")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--mp", type=int, default=1)
    parser.add_argument("--sharding-stage", type=int, default=0, choices=(0, 1, 2, 3),
                        help="shard the optimizer over dp (dist.shard_optimizer); 0: no sharding")
    parser.add_argument("--schedule", default="1F1B", choices=("1F1B", "FThenB"), help="the pipeline's, with --pp")
    parser.add_argument("--accumulate-steps", type=int, default=2, help="microbatches a step, with --pp")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (divided over dp)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write this rank's losses here as JSON")
    args = parser.parse_args(argv)
    _check(args)
    return args


def _check(args) -> None:
    """Degrees the model cannot take, named before anything runs."""
    problems = []
    if args.layers % args.pp:
        problems.append(f"--layers {args.layers} over --pp {args.pp}: each stage needs whole blocks")
    if args.hidden % args.mp:
        problems.append(f"--hidden {args.hidden} (and its 4x) over --mp {args.mp}: each rank needs whole columns")
    micro = args.accumulate_steps if args.pp > 1 else 1
    if args.batch_size % (args.dp * micro):
        problems.append(f"--batch-size {args.batch_size} over --dp {args.dp} x {micro} microbatches")
    if args.sharding_stage and args.dp == 1:
        problems.append("--sharding-stage needs --dp 2 or more (the optimizer is sharded over dp)")
    if problems:
        raise SystemExit("static_mlp: " + "; ".join(problems) + ". Choose degrees that divide.")


def _strategy(args):
    strategy = dist.Strategy()
    if args.pp > 1:
        strategy.pipeline.enable = True
        strategy.pipeline.schedule_mode = args.schedule
        strategy.pipeline.pp_degree = args.pp
        strategy.pipeline.accumulate_steps = args.accumulate_steps
        strategy.pipeline.micro_batch_size = args.batch_size // args.dp // args.accumulate_steps
    return strategy


def main(argv=None):
    args = _parse(argv)
    dist.init_parallel_env()
    ids = np.arange(args.pp * args.dp * args.mp).reshape(args.pp, args.dp, args.mp)
    stage_meshes = [dist.ProcessMesh(ids[s].tolist(), dim_names=["dp", "mp"]) for s in range(args.pp)]
    world_mesh = dist.ProcessMesh(ids.tolist(), dim_names=["pp", "dp", "mp"])
    dist.auto_parallel.set_mesh(world_mesh)  # the whole job's: the dry run's rank classes come from it
    paddle.seed(1234)
    model = Model(args, stage_meshes)
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    if args.sharding_stage:
        stage = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[args.sharding_stage]
        optimizer = dist.shard_optimizer(optimizer, stage("dp", world_mesh))
    loader = paddle.io.DataLoader(Data(args), batch_size=args.batch_size, shuffle=False)
    # x enters on the first stage, y on the last (a pipeline's loader gives one mesh per item of a batch)
    meshes = [stage_meshes[0], stage_meshes[-1]] if args.pp > 1 else stage_meshes[0]
    loader = dist.shard_dataloader(loader, meshes=meshes, shard_dims="dp")
    program = dist.to_static(model, loader, paddle.nn.MSELoss(), optimizer, strategy=_strategy(args))
    program.train()
    losses = []
    for step, (x, y) in enumerate(loader()):
        loss = program(x, y)
        if loss is not None:
            losses.append(float(np.array(loss).reshape(-1)[0]))
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rank": dist.get_rank(), "losses": losses}, f)


if __name__ == "__main__":
    main()
