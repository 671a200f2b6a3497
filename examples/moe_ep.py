"""A mixture-of-experts language model trained with expert parallelism on CPU.

An embedding, one ``paddle.incubate.distributed.models.moe.MoELayer`` feed-forward (top-k gate,
``--moe-experts`` experts in all) and a language-model head, on a generated character corpus.
With ``N`` processes the experts are spread over them (``--moe-experts / N`` a rank, tokens
moved by all-to-all over gloo) and every rank trains on its own part of the global batch: the
gradients of the shared weights (embedding, gate, head) are averaged over the ranks, as data
parallelism does, and those of an expert are already summed over every rank's tokens by the
MoE layer's backward, so they are divided by ``N`` likewise.  The losses printed are those of
the global batch; with the naive gate they equal one process holding every expert (``--ep 1``;
the random gates draw their numbers per rank, so there they only train alike).

    python examples/moe_ep.py --ep 1                                        # one process
    python -m paddle_hybrid.launch --nproc_per_node 2 examples/moe_ep.py    # EP=2
    python -m paddle_hybrid.launch --nproc_per_node 4 examples/moe_ep.py --gate gshard --topk 2
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn

import paddle_hybrid  # noqa: F401  (gloo all-to-all, the CPU routing kernels)

# How `python -m paddle_hybrid.verify` gives this script a layout (docs/verify.md): expert parallel over every
# process (each also a data-parallel replica), the batch given for all replicas together, the experts ep divides;
# the optimizer steps (`python -m paddle_hybrid.dryrun` measures the second).
PADDLE_HYBRID_LAYOUT_FLAGS = {"ep": "--ep", "global_batch": "--global-batch", "experts": "--moe-experts",
                              "steps": "--steps"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: all processes)")
    p.add_argument("--moe-experts", type=int, default=4, help="experts in all, spread over the EP ranks")
    p.add_argument("--gate", default="naive", choices=["naive", "gshard", "switch"])
    p.add_argument("--topk", type=int, default=2, help="experts a token goes to (switch: 1, gshard: 2)")
    p.add_argument("--capacity", type=float, default=8.0, help="gshard/switch capacity factor")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=8, help="sequences a step, over all ranks")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=None, help="write the losses as JSON here (rank 0)")
    args = p.parse_args(argv)
    if args.gate == "switch":
        args.topk = 1
    return args


CHARS = "abcdefghijklmnopqrstuvwxyz ."


def corpus(n_chars, seed=0):
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list(CHARS[:26]), size=rng.integers(2, 7))) for _ in range(50)]
    text = " ".join(rng.choice(words, size=n_chars // 4))
    return np.array([CHARS.index(c) for c in text[:n_chars]], dtype="int64")


def init(layer, rng, scale=0.2):
    """Every weight from NumPy with a fixed seed: the same model in every layout."""
    for p in layer.parameters():
        p.set_value(rng.normal(0, scale, p.shape).astype("float32"))


class Expert(nn.Layer):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


class MoELM(nn.Layer):
    def __init__(self, args, ep_group, ep_rank, ep_size):
        from paddle.incubate.distributed.models.moe import MoELayer
        from paddle.incubate.distributed.models.moe.gate import GShardGate, NaiveGate, SwitchGate

        super().__init__()
        local = args.moe_experts // ep_size
        self.embed = nn.Embedding(len(CHARS), args.hidden)
        self.head = nn.Linear(args.hidden, len(CHARS))
        # expert i of the whole model is built from seed 100 + i, wherever it lives
        experts = nn.LayerList()
        for i in range(ep_rank * local, (ep_rank + 1) * local):
            expert = Expert(args.hidden, args.ffn)
            init(expert, np.random.default_rng(100 + i))
            experts.append(expert)
        if args.gate == "naive":
            gate = NaiveGate(args.hidden, local, ep_size, topk=args.topk)
        elif args.gate == "gshard":
            gate = GShardGate(args.hidden, local, ep_size, topk=2, capacity=(args.capacity,) * 2, group=ep_group)
        else:
            gate = SwitchGate(args.hidden, local, ep_size, topk=1, capacity=(args.capacity,) * 2, group=ep_group)
        init(gate, np.random.default_rng(7), scale=0.5)
        init(self.embed, np.random.default_rng(1), scale=0.5)
        init(self.head, np.random.default_rng(2))
        self.moe = MoELayer(args.hidden, experts, gate=gate, moe_group=ep_group)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.moe(h * 1.0)  # MoELayer reshapes its input in place
        return self.head(h)


def mark_experts(model):
    """An expert's parameters are this rank's own: fleet's data parallelism neither broadcasts
    them at the start nor averages their gradients (``no_sync``; ``expert`` says why)."""
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.no_sync = True
            p.expert = True


def scale_expert_gradients(model, ep_size):
    """An expert's gradient is already summed over every rank's tokens by the MoE layer's backward;
    data parallelism averages the shared weights' over the ranks (``fleet.distributed_model``),
    so the experts' are divided by the ranks likewise."""
    if ep_size == 1:
        return
    with paddle.no_grad():
        for name, p in model.named_parameters():
            if p.grad is not None and getattr(p, "expert", False):
                p.grad.scale_(1.0 / ep_size)


def main(argv=None):
    args = parse_args(argv)
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    ep_size = args.ep or world
    if ep_size != world:
        raise SystemExit(f"--ep {ep_size} but {world} processes: this example runs EP over every process "
                         "(launch with --nproc_per_node equal to --ep).")
    if args.moe_experts % ep_size or args.global_batch % ep_size:
        raise SystemExit(f"--moe-experts {args.moe_experts} and --global-batch {args.global_batch} must be "
                         f"multiples of --ep {ep_size}.")
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": ep_size, "mp_degree": 1, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    # the experts are spread over the data-parallel ranks
    group, rank = (hcg.get_data_parallel_group(), hcg.get_data_parallel_rank()) if ep_size > 1 else (None, 0)

    model = MoELM(args, group, rank, ep_size)
    mark_experts(model)
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters()))
    data = corpus(args.steps * args.global_batch * (args.seq_len + 1) + 1)
    per_rank = args.global_batch // ep_size
    losses = []
    for step in range(args.steps):
        # this step's global batch; this rank takes its share
        start = step * args.global_batch * (args.seq_len + 1)
        seqs = data[start:start + args.global_batch * (args.seq_len + 1)].reshape(args.global_batch, -1)
        mine = seqs[rank * per_rank:(rank + 1) * per_rank]
        x, y = paddle.to_tensor(mine[:, :-1]), paddle.to_tensor(mine[:, 1:])
        paddle.seed(1000 * step + rank)  # the random gates (gshard, switch) draw per rank
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape([-1, len(CHARS)]), y.reshape([-1]))
        loss.backward()
        scale_expert_gradients(model, ep_size)
        opt.step()
        opt.clear_grad()
        global_loss = loss.detach().clone()
        if ep_size > 1:
            dist.all_reduce(global_loss, group=group)
            global_loss = global_loss / ep_size
        losses.append(float(global_loss))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "ep": ep_size, "args": vars(args)}, f)
    return losses


if __name__ == "__main__":
    main()
