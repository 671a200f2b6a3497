"""``MoELayer`` with experts spread over an expert-parallel group, against one process holding
every expert, on every rank.

Every weight is drawn from NumPy with a fixed seed, the same on every rank, so the reference (a
``MoELayer`` with no group and all ``n_ep x E`` experts, the same gate weights) is built in this
very process.  Rank ``r`` trains on its own batch ``x_r``; the reference runs each rank's batch
in turn with the same random draws (``paddle.seed`` before each forward), so a gate's random
routing is the same in both.  Compared on this rank:

* the output and the loss of its own batch;
* the input gradient of its batch (top-2: a token's routes summed);
* the gradient of the gate (from its own batch only);
* the gradients of the experts it holds: every rank of its EP group sends it tokens, so they are
  the sum over the EP group's batches (with ``--dp 2`` all-reduced over the data-parallel
  replicas too, as a data-parallel job does).
"""
import argparse

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn

import paddle_hybrid  # noqa: F401
from paddle_hybrid.testing import save_result

D_MODEL, D_HIDDEN, TOKENS = 8, 16, 12


class Expert(nn.Layer):
    def __init__(self, seed, recompute_inside=False):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.up = nn.Linear(D_MODEL, D_HIDDEN)
        self.down = nn.Linear(D_HIDDEN, D_MODEL)
        for layer in (self.up, self.down):
            layer.weight.set_value(rng.normal(0, 0.3, layer.weight.shape).astype("float32"))
            layer.bias.set_value(rng.normal(0, 0.1, layer.bias.shape).astype("float32"))
        self.recompute_inside = recompute_inside

    def _block(self, x):
        return self.down(paddle.nn.functional.gelu(self.up(x)))

    def forward(self, x):
        if self.recompute_inside and self.training:
            from paddle.distributed.fleet.utils import recompute

            return recompute(self._block, x)
        return self._block(x)


def make_gate(kind, n_local, world, topk, capacity, group):
    from paddle.incubate.distributed.models.moe.gate import GShardGate, NaiveGate, SwitchGate

    if kind == "naive":
        gate = NaiveGate(D_MODEL, n_local, world, topk=topk)
    elif kind == "gshard":
        gate = GShardGate(D_MODEL, n_local, world, topk=2, capacity=(capacity, capacity), group=group)
    else:
        gate = SwitchGate(D_MODEL, n_local, world, topk=1, capacity=(capacity, capacity), group=group)
    rng = np.random.default_rng(7)
    gate.gate.weight.set_value(rng.normal(0, 1.0, gate.gate.weight.shape).astype("float32"))
    gate.gate.bias.set_value(rng.normal(0, 0.5, gate.gate.bias.shape).astype("float32"))
    return gate


def make_layer(args, group, world, first_expert, n_local):
    from paddle.incubate.distributed.models.moe import MoELayer

    experts = nn.LayerList([Expert(100 + first_expert + i, args.recompute) for i in range(n_local)])
    gate = make_gate(args.gate, n_local, world, args.topk, args.capacity, group)
    return MoELayer(D_MODEL, experts, gate=gate, moe_group=group)


def batch(rank, args):
    rng = np.random.default_rng(1000 + rank)
    x = rng.normal(0, 1, [2, TOKENS // 2, D_MODEL]).astype("float32")
    proj = rng.normal(0, 1, [2, TOKENS // 2, D_MODEL]).astype("float32")
    return x, proj


def run(layer, x_np, proj_np, seed, input_grad):
    x = paddle.to_tensor(x_np)
    x.stop_gradient = not input_grad
    paddle.seed(seed)
    out = layer(x * 1.0)  # MoELayer reshapes its input in place, which a leaf refuses
    loss = (out * paddle.to_tensor(proj_np)).sum()
    loss.backward()
    return out.numpy(), float(loss), (x.grad.numpy() if input_grad else None)


def dense_input_grad(reference, x_np, proj_np, topk):
    """The input gradient of the naive gate's MoE written densely (every expert on every token,
    the top-k picked and weighted): autograd of plain ops, no MoE scatter or gather involved."""
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    tokens = x.reshape([-1, D_MODEL])
    val, idx = paddle.topk(reference.gate.gate(tokens), k=topk, axis=-1, largest=True, sorted=False)
    every = paddle.stack([expert(tokens) for expert in reference.experts], axis=1)  # [T, experts, D]
    picked = paddle.take_along_axis(every, idx.unsqueeze(-1).expand([-1, -1, D_MODEL]), axis=1)
    out = (val.unsqueeze(-1) * picked).sum(axis=1).reshape(x.shape)
    (grad,) = paddle.grad((out * paddle.to_tensor(proj_np)).sum(), [x])
    return grad.numpy()


def grads(layer):
    return {name: (p.grad.numpy().copy() if p.grad is not None else np.zeros(p.shape, "float32"))
            for name, p in layer.named_parameters()}


def groups(args):
    """(EP group, EP ranks, DP group or None, this rank's batch ranks summed into its experts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.fleet:
        from paddle.distributed import fleet

        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1, "sharding_degree": 1,
                                   "ep_degree": world,
                                   "order": ["pp", "sharding", "dp", "sep", "cp", "mp", "ep", "moe_sharding"]}
        fleet.init(is_collective=True, strategy=strategy)
        ep = fleet.get_hybrid_communicate_group().get_expert_parallel_group()
        return ep, list(ep.ranks), None
    dist.init_parallel_env()
    if args.dp == 1:
        return dist.collective._get_global_group(), list(range(world)), None
    n_ep = world // args.dp
    ep_groups = [dist.new_group(list(range(i * n_ep, (i + 1) * n_ep))) for i in range(args.dp)]
    dp_groups = [dist.new_group(list(range(j, world, n_ep))) for j in range(n_ep)]
    return ep_groups[rank // n_ep], list(range((rank // n_ep) * n_ep, (rank // n_ep + 1) * n_ep)), \
        dp_groups[rank % n_ep]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gate", default="naive", choices=["naive", "gshard", "switch"])
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--experts", type=int, default=2, help="experts per rank")
    parser.add_argument("--capacity", type=float, default=100.0, help="gshard/switch capacity factor")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--fleet", action="store_true", help="fleet's EP group (ep_degree = world)")
    parser.add_argument("--recompute", action="store_true", help="recompute inside each expert")
    parser.add_argument("--starve-rank", type=int, default=None,
                        help="this rank's experts get no token; the input needs no gradient")
    args = parser.parse_args()

    group, ep_ranks, dp_group = groups(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    n_ep, me = len(ep_ranks), ep_ranks.index(rank)
    E = args.experts
    layer = make_layer(args, group, n_ep, me * E, E)
    reference = make_layer(args, None, 1, 0, n_ep * E)
    if args.starve_rank is not None:
        # a large negative bias on the starved rank's experts: no token is routed to them
        bias = np.zeros([n_ep * E], "float32")
        bias[args.starve_rank * E:(args.starve_rank + 1) * E] = -1e4
        for gate in (layer.gate.gate, reference.gate.gate):
            gate.bias.set_value(bias)
    input_grad = args.starve_rank is None

    x, proj = batch(rank, args)
    out, loss, x_grad = run(layer, x, proj, 50 + rank, input_grad)
    if dp_group is not None:
        for p in layer.experts.parameters():
            dist.all_reduce(p.grad, group=dp_group)

    # the reference: every rank's batch through one process, experts' gradients summed over the
    # ranks whose tokens reach this rank's experts (its EP group, and with DP every replica)
    contributors = list(range(world)) if dp_group is not None else ep_ranks
    ref_expert_grads = None
    for r in contributors:
        xr, pr = batch(r, args)
        for p in reference.gate.parameters():
            p.clear_gradient()
        ref_out, ref_loss, ref_x_grad = run(reference, xr, pr, 50 + r, input_grad)
        if r == rank:
            mine = dict(out=ref_out, loss=ref_loss, x_grad=ref_x_grad, gate=grads(reference.gate))
    ref_expert_grads = grads(reference.experts)
    if args.gate == "naive" and input_grad:
        mine["dense_x_grad"] = dense_input_grad(reference, x, proj, args.topk)
    held = {}
    for i in range(E):
        for name, g in grads(layer.experts[i]).items():
            held[f"{i}.{name}"] = (g, ref_expert_grads[f"{me * E + i}.{name}"])
    save_result(dict(out=out, loss=loss, x_grad=x_grad, gate=grads(layer.gate), experts=held, reference=mine,
                     ep_ranks=ep_ranks, tokens_to_my_experts=int(sum(
                         (p.grad is not None and np.abs(p.grad.numpy()).sum() > 0)
                         for p in layer.experts.parameters()))))


if __name__ == "__main__":
    main()
