"""``dist.to_static`` against dygraph semi-auto for the same model and layout on CPU, 2 gloo ranks,
side by side in one run: MP2 (column then row split), DP2 (batch split), PP2 (two meshes; to_static
with the 1F1B schedule and 2 microbatches, dygraph runs the stages one after another on the whole
batch, which is what dygraph semi-auto does without a pipeline scheduler).

The model: 4 linear blocks of width ``--width`` (relu between), batch ``--batch``, SGD.  Per cell:
the median step time over ``--steps`` steps after 3 warm-up steps, the slowest rank's (no barrier
around a step: its own collectives keep the ranks together).  Prints a
table (default configuration first) and writes ``benchmarks/results/to_static.json``.

    python benchmarks/bench_to_static.py
    python benchmarks/bench_to_static.py --width 512 --batch 64 --steps 30
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
LAYOUTS = ("mp2", "dp2", "pp2")
MODES = ("dygraph", "to_static")


# -- one rank ---------------------------------------------------------------------------------

def worker(layout, mode, width, batch, steps, out):
    import numpy as np
    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (CPU collectives, to_static on CPU)

    dist.init_parallel_env()
    rank = dist.get_rank()
    r, s0, s1 = dist.Replicate(), dist.Shard(0), dist.Shard(1)
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    stages = [dist.ProcessMesh([0], dim_names=["x"]), dist.ProcessMesh([1], dim_names=["x"])]

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            paddle.seed(1)
            self.blocks = paddle.nn.LayerList([paddle.nn.Linear(width, width) for _ in range(4)])
            self.meshes = [stages[0], stages[0], stages[1], stages[1]] if layout == "pp2" else None
            for i, block in enumerate(self.blocks):
                if layout == "mp2":
                    w, b = ([s1], [s0]) if i % 2 == 0 else ([s0], [r])
                    block.weight = dist.shard_tensor(block.weight, mesh, w)
                    block.bias = dist.shard_tensor(block.bias, mesh, b)
                elif layout == "dp2":
                    block.weight = dist.shard_tensor(block.weight, mesh, [r])
                    block.bias = dist.shard_tensor(block.bias, mesh, [r])
                else:
                    block.weight = dist.shard_tensor(block.weight, self.meshes[i], [r])
                    block.bias = dist.shard_tensor(block.bias, self.meshes[i], [r])

        def forward(self, x):
            for i, block in enumerate(self.blocks):
                if self.meshes is not None and x.process_mesh != self.meshes[i]:
                    x = dist.reshard(x, self.meshes[i], [r])
                x = block(x)
                if i < len(self.blocks) - 1:
                    x = paddle.nn.functional.relu(x)
            return x

    class Data(paddle.io.Dataset):
        def __init__(self):
            rng = np.random.RandomState(0)
            self.x = rng.rand(batch * steps, width).astype("float32")  # steps: warm-up included
            self.y = rng.rand(batch * steps, width).astype("float32")

        def __getitem__(self, i):
            return self.x[i], self.y[i]

        def __len__(self):
            return len(self.x)

    net = Net()
    opt = paddle.optimizer.SGD(0.01, parameters=net.parameters())
    loss_fn = paddle.nn.MSELoss()
    loader = paddle.io.DataLoader(Data(), batch_size=batch, shuffle=False)
    meshes = stages if layout == "pp2" else [mesh]
    loader = dist.shard_dataloader(loader, meshes=meshes, shard_dims="x" if layout == "dp2" else None)
    times = []
    if mode == "dygraph":
        for x, y in loader():
            start = time.perf_counter()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            times.append(time.perf_counter() - start)
    else:
        strategy = dist.Strategy()
        if layout == "pp2":
            strategy.pipeline.enable = True
            strategy.pipeline.schedule_mode = "1F1B"
            strategy.pipeline.pp_degree = 2
            strategy.pipeline.accumulate_steps = 2
            strategy.pipeline.micro_batch_size = batch // 2
        model = dist.to_static(net, loader, loss_fn, opt, strategy=strategy)
        model.train()
        for x, y in loader():
            start = time.perf_counter()
            model(x, y)
            times.append(time.perf_counter() - start)
    step = statistics.median(times[3:])
    slowest = paddle.to_tensor([step], dtype="float64")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": float(slowest.numpy()[0]), "steps": len(times) - 3}, f)


# -- the table --------------------------------------------------------------------------------

def measure(layout, mode, args, work):
    out = os.path.join(work, f"{layout}-{mode}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           os.path.join(work, f"log-{layout}-{mode}"), __file__, "--worker", layout, mode, "--width", str(args.width),
           "--batch", str(args.batch), "--steps", str(args.steps), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} {mode} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)["step_s"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "MODE"))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(*args.worker, args.width, args.batch, args.steps + 3, args.out)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_to_static_") as work:
        for layout in LAYOUTS:
            rows[layout] = {mode: measure(layout, mode, args, work) for mode in MODES}
    print(f"dist.to_static vs dygraph semi-auto, 2 CPU ranks over gloo, width {args.width}, batch {args.batch}, "
          f"median of {args.steps} steps (ms a step, slowest rank)")
    print(f"{'layout':<8}{'dygraph':>10}{'to_static':>11}{'ratio':>8}")
    for layout, row in rows.items():
        print(f"{layout:<8}{row['dygraph'] * 1e3:>10.2f}{row['to_static'] * 1e3:>11.2f}"
              f"{row['to_static'] / row['dygraph']:>7.2f}x")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "to_static.json"), "w") as f:
        json.dump({"config": vars(args), "step_s": rows}, f, indent=1)


if __name__ == "__main__":
    main()
