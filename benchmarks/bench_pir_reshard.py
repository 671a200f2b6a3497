"""Does PIR's reshard pass pay a cost per inserted op, as the legacy ``_reshard_input`` did (a
``_sync_with_cpp`` per insert: 23.9 s for a 48-block program, 18.9 s with this project's deferred
sync)?  ``dist.to_static`` of an MP2 MLP of N blocks (each a column-split and a row-split linear,
so every block's forward and backward insert reshards), 2 CPU ranks: the time of
``ReshardPasses.apply_reshard_pass`` on the training program, its ops before and the change in
their number, and the time per op of the program, for N = 12, 24, 48.  A constant time per op
means no cost grows with the program (nothing to defer).  Prints a table and writes ``benchmarks/results/pir_reshard.json``.

    python benchmarks/bench_pir_reshard.py
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def worker(blocks, out):
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.auto_parallel.static import pir_pass

    import paddle_hybrid  # noqa: F401

    dist.init_parallel_env()
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    timed = {}
    original = pir_pass.ReshardPasses.apply_reshard_pass

    def apply_reshard_pass(program, *args, **kwargs):
        before = len(program.global_block().ops)
        start = time.perf_counter()
        result = original(program, *args, **kwargs)
        timed.setdefault("calls", []).append((time.perf_counter() - start, len(program.global_block().ops) - before,
                                              before))
        return result

    pir_pass.ReshardPasses.apply_reshard_pass = staticmethod(apply_reshard_pass)

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.layers = paddle.nn.LayerList()
            for _ in range(blocks):
                up, down = paddle.nn.Linear(32, 64), paddle.nn.Linear(64, 32)
                up.weight = dist.shard_tensor(up.weight, mesh, [dist.Shard(1)])
                down.weight = dist.shard_tensor(down.weight, mesh, [dist.Shard(0)])
                self.layers.extend([up, down])

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i % 2 == 0:
                    x = paddle.nn.functional.relu(x)
            return x

    class Data(paddle.io.Dataset):
        def __getitem__(self, i):
            return np.ones([32], "float32"), np.ones([32], "float32")

        def __len__(self):
            return 4

    net = Net()
    loader = dist.shard_dataloader(paddle.io.DataLoader(Data(), batch_size=4), meshes=[mesh])
    model = dist.to_static(net, loader, paddle.nn.MSELoss(), paddle.optimizer.SGD(0.01, parameters=net.parameters()))
    start = time.perf_counter()
    model.train()  # builds and partitions the training program
    build = time.perf_counter() - start
    main_call = max(timed["calls"], key=lambda c: c[2])  # the training program's (the largest)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"reshard_s": main_call[0], "inserted": main_call[1], "ops_before": main_call[2],
                       "build_s": build}, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--worker", type=int)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    rows = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory(prefix="bench_pir_reshard_") as work:
        for n in args.blocks:
            out = os.path.join(work, f"{n}.json")
            proc = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                                   "--log_dir", os.path.join(work, f"log{n}"), __file__, "--worker", str(n), "--out",
                                   out], env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{n} blocks failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            with open(out) as f:
                rows[n] = json.load(f)
    print("PIR reshard pass (dist.to_static, MP2, N blocks of column + row split linears)")
    print(f"{'blocks':>6}{'ops before':>12}{'change':>8}{'reshard s':>11}{'ms / op':>9}{'build s':>9}")
    for n, row in rows.items():
        per = row["reshard_s"] / row["ops_before"] * 1e3
        print(f"{n:>6}{row['ops_before']:>12}{row['inserted']:>8}{row['reshard_s']:>11.3f}{per:>9.3f}"
              f"{row['build_s']:>9.2f}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "pir_reshard.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
