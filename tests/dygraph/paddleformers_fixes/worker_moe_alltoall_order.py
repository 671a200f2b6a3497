"""PaddleFormers 1.2's ``ModularMoELayer`` with ``moe_token_dispatcher_type="alltoall"`` on an
expert-parallel group of 2 (fleet ``ep_degree`` 2): the same two sequences as one micro-batch of 2
and as two micro-batches of 1, on every rank.

The layer is built as Qwen3-MoE builds it under EP > 1 (``QuickAccessMoEFactory``, softmax gate,
greedy top-k), with 4 experts (2 a rank), top-2, and an expert class of this file (up, gelu, down)
whose weights are drawn from NumPy by expert index, the same on every rank; the gate's weight too.
Rank ``r`` feeds its own two sequences (seeded by ``r``).  Saved per rank:

* ``out2``, ``out1``: the outputs ``[2, seq, hidden]`` of the micro-batch of 2 and of the two
  micro-batches of 1 (concatenated);
* ``dense``: the mixture written densely: every expert (all 4, rebuilt here from the same seeds)
  on every token, weighted by the gate's ``gates_masked`` (PaddleFormers' own gate, per token);
* ``misrouted``: the same mixture with each (token, expert) pair computed by the expert whose run
  the stock key sorts it into (:func:`misrouted_mixture`): the defect's mechanism, to compare with
  the stock ``out2``;
* ``grads2``, ``grads1``: the input gradient and the gradients of the gate and of the experts this
  rank holds, from ``sum(out * proj)`` (the two micro-batches' gradients accumulated);
* ``pairs_out_of_run``: how many (token, expert) pairs of the micro-batch of 2 the key
  ``expert * seq_len + token`` sorts outside their expert's run (a stable sort of the key; ties
  may be ordered otherwise by Paddle's argsort: an illustration, not asserted beyond > 0).

PaddleFormers 1.2 imports ``paddlefleet_ops`` (GPU-only, not on the package index) when the MoE
module is imported, and ``ModularMoELayer`` builds ``MoEFlexTokenDispatcher`` under EP > 1, which
asks for DeepEP's fused kernels to exist.  The all-to-all path never calls them (the dispatcher is
handed to ``AllToAllMoECommunication.forward`` and unused), so ``paddlefleet_ops`` is stubbed here
with DeepEP reported available and a ``deep_ep`` module that raises if anything is taken from it.
Run by ``test_moe_alltoall_order.py`` in processes of its own: the stubs reach no other test.
``PADDLE_HYBRID_PADDLEFORMERS_FIXES=0`` in the environment gives stock PaddleFormers.
"""
import sys
import types

import numpy as np

HIDDEN, FFN, EXPERTS, TOP_K, SEQ, SEQS = 8, 16, 4, 2, 6, 2


def stub_paddlefleet_ops():
    class _Absent(types.ModuleType):
        def __getattr__(self, name):
            raise AttributeError(f"stub paddlefleet_ops.deep_ep (test): {name} was asked for; the all-to-all "
                                 f"path should not use DeepEP")

    ops = types.ModuleType("paddlefleet_ops")
    ops.is_deep_ep_available = lambda: True
    deep_ep = _Absent("paddlefleet_ops.deep_ep")
    ops.deep_ep = deep_ep
    sys.modules["paddlefleet_ops"] = ops
    sys.modules["paddlefleet_ops.deep_ep"] = deep_ep


def expert_class():
    import paddle
    from paddle import nn

    class Expert(nn.Layer):
        """What ``ModularMoELayer`` builds an expert with: ``config``, ``intermediate_size``,
        ``fuse_up_gate`` (unused)."""

        def __init__(self, config, intermediate_size, fuse_up_gate=True):
            super().__init__()
            self.up = nn.Linear(config.hidden_size, intermediate_size)
            self.down = nn.Linear(intermediate_size, config.hidden_size)

        def set_weights(self, index):
            rng = np.random.default_rng(100 + index)
            for layer in (self.up, self.down):
                layer.weight.set_value(rng.normal(0, 0.5, layer.weight.shape).astype("float32"))
                layer.bias.set_value(rng.normal(0, 0.2, layer.bias.shape).astype("float32"))

        def forward(self, x):
            return self.down(paddle.nn.functional.gelu(self.up(x)))

    return Expert


def config():
    from paddleformers.transformers.configuration_utils import PretrainedConfig

    cfg = PretrainedConfig(hidden_size=HIDDEN, moe_intermediate_size=FFN, num_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, norm_topk_prob=True, hidden_act="gelu",
                           seq_length=SEQ)
    cfg.model_type = "moe_alltoall_order_test"
    cfg.moe_token_dispatcher_type = "alltoall"  # set after __init__: its table of MoE defaults resets the keyword
    return cfg


def build_layer(Expert):
    from paddleformers.nn.moe_deepep.moe_factory import QuickAccessMoEFactory

    layer = QuickAccessMoEFactory.create_from_model_name(
        pretrained_config=config(), expert_class=Expert, gate_activation="softmax", expert_activation="gelu",
        train_topk_method="greedy", inference_topk_method="greedy", transpose_gate_weight=False)
    assert type(layer.communication).__name__ == "AllToAllMoECommunication", type(layer.communication)
    assert layer.expert_model_parallel_size == 2 and layer.num_experts_per_device == 2
    rng = np.random.default_rng(7)
    layer.gate.weight.set_value(rng.normal(0, 2.0, layer.gate.weight.shape).astype("float32"))
    held = [i for i, expert in enumerate(layer.experts) if expert is not None]
    for i in held:
        layer.experts[i].set_weights(i)
    return layer, held


def grads(layer, x, held):
    got = {"x": x.grad.numpy().copy(), "gate": layer.gate.weight.grad.numpy().copy()}
    for i in held:
        for name, p in layer.experts[i].named_parameters():
            got[f"expert{i}.{name}"] = p.grad.numpy().copy()
    return got


def pairs_out_of_run(mask, seq_len):
    """(token, expert) pairs that ``argsort(expert * seq_len + token)`` (stable) puts outside the
    run of ``tokens_per_expert`` their expert is given."""
    tokens, experts = np.nonzero(mask)  # row-major, as paddle.where
    order = np.argsort(experts * seq_len + tokens, kind="stable")
    run_of_position = np.repeat(np.arange(mask.shape[1]), mask.sum(axis=0).astype(int))
    return int((experts[order] != run_of_position).sum())


def misrouted_mixture(every, gates_masked, mask, seq_len):
    """What the micro-batch of 2 computes if each (token, expert) pair goes to the expert whose run
    of ``tokens_per_expert`` the key ``expert * seq_len + token`` sorts it into (Paddle's own argsort
    of that key, ties as Paddle orders them), weighted by its chosen expert's gate value and added
    to its own token: the defect's mechanism, compared with the stock output by the test."""
    import paddle

    tokens, experts = np.nonzero(mask)
    order = paddle.argsort(paddle.to_tensor(experts * seq_len + tokens)).numpy()
    run_of_position = np.repeat(np.arange(mask.shape[1]), mask.sum(axis=0).astype(int))
    out = np.zeros((mask.shape[0], every.shape[-1]), "float32")
    for position, pair in enumerate(order):
        token, chosen = tokens[pair], experts[pair]
        out[token] += gates_masked[token, chosen] * every[token, run_of_position[position]]
    return out


def main():
    stub_paddlefleet_ops()
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.testing import save_result

    world = dist.get_world_size()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1, "sharding_degree": 1,
                               "ep_degree": world,
                               "order": ["pp", "sharding", "dp", "sep", "cp", "mp", "ep", "moe_sharding"]}
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()

    Expert = expert_class()
    layer, held = build_layer(Expert)
    patched = [(p["component"], p["owner"], p["name"]) for p in paddle_hybrid.patches()
               if p["owner"] == "AllToAllMoECommunication"]
    reference = [Expert(config(), FFN) for _ in range(EXPERTS)]
    for i, expert in enumerate(reference):
        expert.set_weights(i)

    rng = np.random.default_rng(1000 + rank)
    x_np = rng.normal(0, 1, [SEQS, SEQ, HIDDEN]).astype("float32")
    proj = paddle.to_tensor(rng.normal(0, 1, [SEQS, SEQ, HIDDEN]).astype("float32"))

    # one micro-batch of 2
    x = paddle.to_tensor(x_np, stop_gradient=False)
    out2 = layer(x)
    (out2 * proj).sum().backward()
    grads2 = grads(layer, x, held)
    layer.clear_gradients()

    # the same sequences as two micro-batches of 1, gradients accumulated
    x = paddle.to_tensor(x_np, stop_gradient=False)
    out1 = []
    for b in range(SEQS):
        out = layer(x[b:b + 1])
        (out * proj[b:b + 1]).sum().backward()
        out1.append(out.numpy())
    grads1 = grads(layer, x, held)
    out1 = np.concatenate(out1, axis=0)

    with paddle.no_grad():
        tokens = paddle.to_tensor(x_np.reshape([-1, HIDDEN]))
        _, _, _, gates_masked, mask, _, _, _ = layer.gate(tokens)
        every = np.stack([expert(tokens).numpy() for expert in reference], axis=1)  # [tokens, experts, hidden]
        dense = (gates_masked.numpy()[:, :, None] * every).sum(axis=1).reshape(x_np.shape)
        misrouted = misrouted_mixture(every, gates_masked.numpy(), mask.numpy(), SEQ).reshape(x_np.shape)

    save_result(dict(rank=rank, patched=patched, out2=out2.numpy(), out1=out1, dense=dense, misrouted=misrouted, grads2=grads2,
                     grads1=grads1, pairs_out_of_run=pairs_out_of_run(mask.numpy(), SEQ),
                     pairs_out_of_run_flat=pairs_out_of_run(mask.numpy(), SEQS * SEQ), held=held))


if __name__ == "__main__":
    main()
