"""Tiny Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GLM4-MoE (PaddleFormers 1.2) with balanced routing on
and off, in one process on CPU; prints one JSON line ``{family: {"on": ..., "off": ...}}``.

PaddleFormers 1.2 imports GPU-only packages when these model modules are imported (paddlefleet for
``transformers/gpt_provider.py``, paddlefleet_ops for ``transformers/fused_a2a.py``); neither is used
by the MoE blocks built here (one process, no expert parallelism), so both are stubbed before the
import.  Run by ``test_paddleformers_gates.py`` in a process of its own: the stubs never reach
another test.

Qwen2-MoE's, Qwen3-MoE's and GLM4-MoE's ``...ForCausalLM`` are paddlefleet's ``GPTModel`` in
PaddleFormers 1.2 (its routing is paddlefleet's); PaddleFormers' own model of them is the
``...ForCausalLMDeprecated`` class, built here.  DeepSeek-V3's ``ForCausalLM`` is PaddleFormers' own.

For each family and setting: one training step of the whole model (hidden 32, 2 MoE layers, 4
experts, top-2) and the routing record of it; then the first layer's MoE block (Qwen) or router
(DeepSeek-V3, GLM4-MoE), trained to prefer experts 0 and 1, called alone on 10 positive tokens:
the experts it chose, whether its output (Qwen: the block's output against one computed from the
chosen experts and the gate's normalized softmax scores at them; the routers: their weights against
their sigmoid scores at the chosen experts, normalized and scaled) follows from them, and the gate
weight's gradient.
"""
import dataclasses
import json
import sys
import types

import numpy as np

TOKENS, EXPERTS, TOP_K, HIDDEN = 10, 4, 2, 32
COMMON = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=None,
              dtype="float32", fuse_rms_norm=False, use_fused_head_and_loss_fn=False,
              use_fused_linear_cross_entropy=False, fuse_swiglu=False, apply_rope_fusion=False,
              num_experts_per_tok=TOP_K, norm_topk_prob=True,
              _attn_implementation="sdpa")
FAMILIES = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLMDeprecated",
                  dict(num_experts=EXPERTS, shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated",
                  dict(num_experts=EXPERTS, head_dim=8, decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=EXPERTS, n_shared_experts=1, n_group=2,
                         topk_group=1, routed_scaling_factor=2.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "factor": 1.0})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated",
                 dict(first_k_dense_replace=0, head_dim=8, n_routed_experts=EXPERTS, n_shared_experts=1, n_group=2,
                      topk_group=1, routed_scaling_factor=2.5)),
}


def stub_gpu_only_imports():
    ops = types.ModuleType("paddlefleet_ops")
    ops.is_deep_ep_available = lambda: False
    sys.modules["paddlefleet_ops"] = ops
    provider = types.ModuleType("paddleformers.transformers.gpt_provider")

    class GPTModelProvider:  # what the model modules subclass (their providers are not used here)
        transform_rules: dict = {}

    provider.GPTModelProvider = GPTModelProvider
    provider.GPTModel = type("GPTModel", (), {})
    sys.modules["paddleformers.transformers.gpt_provider"] = provider


def positive_input():
    import paddle

    return paddle.to_tensor(np.abs(np.random.default_rng(0).normal(size=(TOKENS, HIDDEN))).astype("float32") + 0.1)


def prefer_experts_0_and_1(weight, experts_axis):
    import paddle

    columns = np.zeros(EXPERTS, np.float32)
    columns[:2] = [1.0, 0.5]
    shape = [1, 1]
    shape[experts_axis] = EXPERTS
    with paddle.no_grad():
        weight.set_value(paddle.to_tensor(np.broadcast_to(columns.reshape(shape), weight.shape).copy()))


def qwen_block(block, family):
    """The sparse MoE block alone: the experts its ``one_hot`` was given, and its output against one
    computed from them."""
    import paddle
    import paddle.nn.functional as F

    seen = []
    real_one_hot = F.one_hot

    def spy(x, num_classes, name=None):
        seen.append(x.numpy().copy())
        return real_one_hot(x, num_classes, name=name)

    weight = block.gate.weight  # [hidden, experts]
    prefer_experts_0_and_1(weight, 1)
    x = positive_input()
    F.one_hot = spy
    try:
        out, _ = block(x)
    finally:
        F.one_hot = real_one_hot
    chosen = seen[0]
    probs = F.softmax(x @ weight, axis=-1).numpy()
    at = np.take_along_axis(probs, chosen, axis=1)
    at = at / at.sum(1, keepdims=True)  # norm_topk_prob
    with paddle.no_grad():
        want = np.zeros((TOKENS, HIDDEN), np.float32)
        for t in range(TOKENS):
            for i in range(TOP_K):
                want[t] += at[t, i] * block.experts[int(chosen[t, i])](x[t:t + 1]).numpy()[0]
        if family == "qwen2_moe":
            want += (F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)).numpy()
    (out * paddle.arange(HIDDEN, dtype="float32")).sum().backward()
    return {"block_chosen": chosen.tolist(),
            "weights_match": bool(np.allclose(out.numpy(), want, rtol=1e-4, atol=1e-6)),
            "gate_grad": float(weight.grad.abs().sum()), "weights_dtype": str(out.dtype)}


def router(gate):
    """DeepSeek-V3's / GLM4-MoE's router alone: its experts and its weights against its scores."""
    import paddle
    import paddle.nn.functional as F

    experts_axis = 1 if gate.weight.shape[1] == EXPERTS else 0
    prefer_experts_0_and_1(gate.weight, experts_axis)
    x = positive_input()
    indices, weights = gate(x)
    w = gate.weight if experts_axis == 1 else gate.weight.t()
    at = np.take_along_axis(F.sigmoid(x @ w).numpy(), indices.numpy(), axis=1)
    want = at / (at.sum(1, keepdims=True) + 1e-20) * gate.routed_scaling_factor
    (weights * paddle.arange(TOP_K, dtype="float32")).sum().backward()
    return {"block_chosen": indices.numpy().tolist(),
            "weights_match": bool(np.allclose(weights.numpy(), want, rtol=1e-5)),
            "gate_grad": float(gate.weight.grad.abs().sum()), "weights_dtype": str(weights.dtype),
            "weights_shape": list(weights.shape)}


def run(family, on, base_config):
    import importlib

    import paddle
    import paddle_hybrid
    from paddle_hybrid.common import routing_record

    paddle_hybrid.uninstall()
    paddle_hybrid.install(dataclasses.replace(base_config, balanced_routing=on))
    config_name, model_name, own = FAMILIES[family]
    classes = importlib.import_module(f"paddleformers.transformers.{family}.modeling")
    paddle.seed(5)
    model = getattr(classes, model_name)(getattr(classes, config_name)(**COMMON, **own))
    model.train()
    routing_record.clear()
    ids = paddle.to_tensor(np.arange(TOKENS).reshape(2, TOKENS // 2) % 64)
    out = model(input_ids=ids, labels=ids)
    (out[0] if isinstance(out, tuple) else out.loss).backward()
    record = routing_record.summary()
    model.clear_gradients()
    mlp = model.model.layers[0].mlp
    found = qwen_block(mlp, family) if family.startswith("qwen") else router(mlp.gate)
    found["record"] = record
    found["block_class"] = type(mlp).__name__
    return found


def main():
    stub_gpu_only_imports()
    import paddle

    import paddle_hybrid

    paddle.set_device("cpu")
    base = paddle_hybrid.current_config()
    results = {family: {"on": run(family, True, base), "off": run(family, False, base)} for family in FAMILIES}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
