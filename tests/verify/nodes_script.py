"""A data-parallel fleet script for ``python -m paddle_hybrid.verify --nnodes``.

``--share fleet`` takes this replica's share of the batch by fleet's data-parallel rank.  ``--share
local`` plants a defect that shows only across nodes: it takes the share by ``PADDLE_LOCAL_RANK``,
the rank within this node, as code written for one machine does (local rank taken for the global
topology's).  On one node the two are the same and the layout equals one process; on two nodes of
one rank each both replicas have local rank 0, both train on the first half of every batch, and
the gradients differ from one process's from step 1.

``--fail-rank R``: global rank R raises after step 1 (its peers then wait in step 2's collective).

Each rank prints, at the end, how many collectives took the plugin's same-host shared-memory path
(``shared-memory collectives: N``) and what its node holds: the test reads them from the logs.
"""
import argparse
import os

import numpy as np
import paddle
from paddle.distributed import fleet

from paddle_hybrid.gloo import local_p2p, local_ring

HIDDEN, BATCH = 8, 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--share", choices=["fleet", "local"], default="fleet")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this global rank raises before step 2")
    args = parser.parse_args()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": 1, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dp = hcg.get_data_parallel_world_size()
    replica = hcg.get_data_parallel_rank() if args.share == "fleet" else int(os.environ.get("PADDLE_LOCAL_RANK", 0))
    paddle.seed(1)
    net = paddle.nn.Sequential(paddle.nn.Linear(HIDDEN, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 1))
    model = fleet.distributed_model(net)
    optimizer = fleet.distributed_optimizer(paddle.optimizer.AdamW(0.05, parameters=model.parameters()))
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        x = rng.standard_normal((BATCH, HIDDEN)).astype("float32")
        y = rng.standard_normal((BATCH, 1)).astype("float32")
        part = slice(replica * BATCH // dp, (replica + 1) * BATCH // dp)  # this replica's share
        loss = ((model(paddle.to_tensor(x[part])) - paddle.to_tensor(y[part])) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        print(f"step {step + 1} loss {float(loss):.6f}", flush=True)
        if paddle.distributed.get_rank() == args.fail_rank:
            raise RuntimeError(f"planted failure on rank {args.fail_rank}")
    print(f"shared-memory collectives: {sum(local_ring.calls().values()) + sum(local_p2p.calls().values())} "
          f"(PADDLE_NNODES {os.environ.get('PADDLE_NNODES')}, PADDLE_LOCAL_SIZE {os.environ.get('PADDLE_LOCAL_SIZE')})",
          flush=True)


if __name__ == "__main__":
    main()
