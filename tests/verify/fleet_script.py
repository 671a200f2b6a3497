"""A plain fleet training script, as a user writes one: tensor-parallel layers built from fleet's
hybrid group, data split by the data-parallel rank, ``loss.backward()`` and ``optimizer.step()``.
Its degrees are its own flags (``--mp``, ``--dp``; 1 by default), so ``python -m
paddle_hybrid.verify`` must set them through fleet (a "fleet" script).

``--defect`` builds in, on purpose, one of the silent defects the verifier must name:

* ``sized_per_rank``: a gate of ``FFN / mp`` values per rank, not marked distributed (PaddleFormers'
  GPT-OSS ``sinks``): with mp = 2 each rank holds and trains its own half;
* ``partial_grad``: a scale, held whole by every tensor-parallel rank, applied to the
  column-parallel half of the activations: each rank's gradient is its half's, never summed
  (DeepSeek-V3's ``kv_a_proj_with_mqa`` k_pe columns); the replicas drift apart;
* ``desync``: after step 1 the last rank moves a norm weight (a replica check must stop the run).
"""
import argparse

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

HIDDEN, FFN, BATCH = 8, 16, 8


class Block(paddle.nn.Layer):
    def __init__(self, mp: int, defect: str):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(HIDDEN)
        self.up = ColumnParallelLinear(HIDDEN, FFN, has_bias=True, gather_output=False)
        self.down = RowParallelLinear(FFN, HIDDEN, has_bias=True, input_is_parallel=True)
        self.defect = defect
        if defect == "sized_per_rank":
            self.gate = self.create_parameter([FFN // mp], default_initializer=paddle.nn.initializer.Constant(1.0))
        if defect == "partial_grad":
            self.scale = self.create_parameter([1], default_initializer=paddle.nn.initializer.Constant(1.0))
        self.head = paddle.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = paddle.tanh(self.up(self.norm(x)))
        if self.defect == "sized_per_rank":
            h = h * self.gate
        if self.defect == "partial_grad":
            h = h * self.scale
        return self.head(x + self.down(h))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--defect", default="none", choices=["none", "sized_per_rank", "partial_grad", "desync"])
    args = parser.parse_args()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    mp, dp, dp_rank = hcg.get_model_parallel_world_size(), hcg.get_data_parallel_world_size(), \
        hcg.get_data_parallel_rank()
    paddle.seed(1)
    model = fleet.distributed_model(Block(mp, args.defect))
    optimizer = fleet.distributed_optimizer(paddle.optimizer.AdamW(0.05, parameters=model.parameters()))
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        x = rng.standard_normal((BATCH, HIDDEN)).astype("float32")
        y = rng.standard_normal((BATCH, 1)).astype("float32")
        part = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)  # this replica's share
        loss = ((model(paddle.to_tensor(x[part])) - paddle.to_tensor(y[part])) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        if args.defect == "desync" and step == 0 and dist.get_rank() == dist.get_world_size() - 1:
            inner = model._layers if hasattr(model, "_layers") else model
            inner.norm.weight.set_value(inner.norm.weight + 1e-3)
        print(f"step {step + 1} loss {float(loss):.6f}", flush=True)


if __name__ == "__main__":
    main()
