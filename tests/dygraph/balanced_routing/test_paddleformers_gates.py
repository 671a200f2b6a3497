"""Forced-balanced routing of PaddleFormers 1.2's MoE gates (``balanced_routing.paddleformers_gates``).

Every gate here is built trained to send every token to experts 0 and 1 (positive inputs, gate
columns 1 and 0.5 for experts 0 and 1, 0 for the rest): the stock routing is [10, 10, 0, 0] over 10
tokens, the balanced one [5, 5, 5, 5] with token ``t`` on experts ``2t mod 4, 2t + 1 mod 4``.

- in this process (the modules that import on CPU): GPT-OSS (a tiny model, hidden 32, 2 layers, 4
  experts, top-2: its router's ``topk``), the top-k choosers of ``PretrainedMoEGate`` (through
  ``topkgating`` and ``topkgating_nodrop``) and of the modular layer's ``StandardMoEGate``, for each
  top-k method (greedy, group-limited greedy, noaux_tc);
- in a subprocess (:mod:`worker_paddleformers_families`), with PaddleFormers' GPU-only imports
  (paddlefleet, paddlefleet_ops) stubbed so the modules import on CPU: tiny Qwen2-MoE, Qwen3-MoE,
  DeepSeek-V3 and GLM4-MoE models (hidden 32, 2 layers, 4 experts, top-2, one process) trained one
  step, and each family's MoE block or router called alone;
- the dry run of examples/paddleformers_trainer.py on its tiny GPT-OSS, 2 ranks: each rank's record.

Each checks the chosen experts are exactly the round-robin ones, the combine weights have the gate's
shape and dtype and are its (normalized) scores at them, the gate's weight gets a gradient, and the
routing is recorded; without the component the stock routing (the same gates) is seen.

Seen failing first: with ``paddleformers_gates.apply`` taken out of the component's ``apply`` (the
component as it was, Paddle's incubate gates only), the 15 balanced cases failed on the stock routing
(experts 0 and 1 for every token, no record) and the 15 stock ones passed; the dry run's classes
reported no routing (null).
"""
import dataclasses
import json
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

import paddle
import paddle_hybrid
from paddle_hybrid.common import routing_record
from paddle_hybrid.dygraph.balanced_routing import balanced_indices

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "paddleformers_fixes"))
from test_paddleformers_llama import paddleformers_version  # noqa: E402,F401  (the fixture: skip / fail / ok)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_paddleformers_families import prefer_experts_0_and_1  # noqa: E402  (shared with the worker)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TOKENS, EXPERTS, TOP_K, HIDDEN = 10, 4, 2, 8
ROUND_ROBIN = balanced_indices(TOKENS, TOP_K, EXPERTS)
STOCK = np.tile([0, 1], (TOKENS, 1))


@pytest.fixture(params=[True, False], ids=["balanced", "stock"])
def balanced(request, plugin_restored, paddleformers_version):
    """The plugin with ``balanced_routing`` on (True) or off (False)."""
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    paddle_hybrid.install(dataclasses.replace(config, balanced_routing=request.param))
    routing_record.clear()
    yield request.param
    routing_record.clear()


def _positive_input(tokens=TOKENS, hidden=HIDDEN):
    return paddle.to_tensor(np.abs(np.random.default_rng(0).normal(size=(tokens, hidden))).astype("float32") + 0.1)


def _expected(on):
    return ROUND_ROBIN if on else STOCK


def _assert_recorded(on, calls=1, top_k=TOP_K, counts=None):
    if on:
        counts = counts if counts is not None else [TOKENS * top_k // EXPERTS] * EXPERTS
        assert routing_record.summary() == {"mode": "forced-balanced", "gate_calls": calls, "top_k": top_k,
                                            "tokens_per_expert": counts}
    else:
        assert routing_record.summary() is None


def _sorted_rows(indices):
    return np.sort(np.asarray(indices), axis=1)


# --------------------------------------------------------------------------- GPT-OSS


def _tiny_gpt_oss():
    from paddleformers.transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(num_hidden_layers=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=64,
                          hidden_size=32, intermediate_size=32, head_dim=8, num_attention_heads=4,
                          num_key_value_heads=4, sliding_window=None, layer_types=["full_attention"] * 2,
                          max_position_embeddings=64, pad_token_id=None, fuse_rms_norm=False, dtype="float32",
                          _attn_implementation="eager")
    paddle.seed(3)
    return GptOssForCausalLM(config)


def test_gpt_oss_router(balanced):
    model = _tiny_gpt_oss()
    router = model.model.layers[0].mlp.router
    prefer_experts_0_and_1(router.weight, 0)  # [experts, hidden]
    with paddle.no_grad():
        router.bias.set_value(paddle.zeros_like(router.bias))
    x = _positive_input(hidden=32)
    scores, chosen = router(x)
    assert chosen.dtype == paddle.int64 and scores.shape == [TOKENS, EXPERTS] and scores.dtype == paddle.float32
    np.testing.assert_array_equal(_sorted_rows(chosen.numpy()), _expected(balanced))
    # the router's own weights: the softmax of its logits at the chosen experts, 0 elsewhere
    logits = (x @ router.weight.t() + router.bias).numpy()
    at = np.take_along_axis(logits, chosen.numpy(), axis=1)
    want = np.zeros_like(logits)
    np.put_along_axis(want, chosen.numpy(), np.exp(at) / np.exp(at).sum(1, keepdims=True), axis=1)
    np.testing.assert_allclose(scores.numpy(), want, rtol=1e-5, atol=1e-7)
    (scores * paddle.arange(EXPERTS, dtype="float32")).sum().backward()
    assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0
    _assert_recorded(balanced)


def test_gpt_oss_model_step(balanced):
    model = _tiny_gpt_oss()
    model.train()
    for layer in model.model.layers:
        prefer_experts_0_and_1(layer.mlp.router.weight, 0)
    ids = paddle.to_tensor(np.arange(TOKENS).reshape(2, TOKENS // 2) % 64)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert all(float(layer.mlp.router.weight.grad.abs().sum()) > 0 for layer in model.model.layers)
    _assert_recorded(balanced, calls=2)


# --------------------------------------------------------------------------- the gate base classes

METHODS = ["greedy", "group_limited_greedy", "noaux_tc"]


def _pretrained_gate(method):
    from paddleformers.transformers.moe_gate import PretrainedMoEGate

    config = types.SimpleNamespace(scoring_func="softmax")  # no seq_aux: the plain auxiliary loss
    gate = PretrainedMoEGate(config, EXPERTS, HIDDEN, top_k=TOP_K, topk_method=method, n_group=2, topk_group=1,
                             norm_topk_prob=True)
    gate.weight = paddle.create_parameter([HIDDEN, EXPERTS], "float32")  # as Qwen3MoeGate's
    gate.e_score_correction_bias = paddle.zeros([EXPERTS], "float32")  # noaux_tc's, as DeepSeek-V3's gate
    prefer_experts_0_and_1(gate.weight, 1)
    return gate


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("gating", ["topkgating", "topkgating_nodrop"])
def test_pretrained_moe_gate(balanced, method, gating):
    gate = _pretrained_gate(method)
    scores = paddle.nn.functional.softmax(_positive_input() @ gate.weight, axis=-1)
    if gating == "topkgating":
        capacity, weights, chosen, priority, l_aux, l_zloss = gate.topkgating(scores)
        assert weights.shape == [TOKENS, TOP_K] and weights.dtype == paddle.float32
        assert capacity == (TOKENS * TOP_K // EXPERTS if balanced else TOKENS)  # no drop: the largest count
        at = np.take_along_axis(scores.numpy(), chosen.numpy(), axis=1)
        np.testing.assert_allclose(weights.numpy(), at / at.sum(1, keepdims=True), rtol=1e-5)  # norm_topk_prob
        chosen = chosen.numpy()
    else:
        weights, mask, exp_counts, l_aux, l_zloss = gate.topkgating_nodrop(scores)
        assert weights.shape == [TOKENS, EXPERTS] and weights.dtype == paddle.float32
        chosen = np.stack([np.flatnonzero(row) for row in mask.numpy()])
        assert exp_counts.numpy().tolist() == np.bincount(_expected(balanced).reshape(-1), minlength=EXPERTS).tolist()
    np.testing.assert_array_equal(_sorted_rows(chosen), _expected(balanced))
    assert l_aux.shape == [] and l_aux.dtype == paddle.float32
    (weights.sum() + l_aux).backward()
    assert float(gate.weight.grad.abs().sum()) > 0
    _assert_recorded(balanced)


def _standard_gate(method):
    from paddleformers.nn.moe_deepep.moe_gate import StandardMoEGate

    gate = StandardMoEGate(num_experts=EXPERTS, expert_hidden_size=HIDDEN, drop_tokens=False, topk_method=method,
                           num_experts_per_tok=TOP_K, norm_topk_prob=True, moe_config={"seq_aux": False},
                           seq_length=TOKENS, n_group=2, topk_group=1, routed_scaling_factor=1.0,
                           moe_subbatch_token_num_before_dispatch=0, tensor_model_parallel_size=1,
                           sequence_parallel=False, moe_expert_capacity_factor=0.0, moe_token_drop_policy="probs",
                           transpose_gate_weight=False)
    prefer_experts_0_and_1(gate.weight, 1)
    return gate


@pytest.mark.parametrize("method", METHODS)
def test_modular_layer_gate(balanced, method):
    gate = _standard_gate(method)
    x = _positive_input()
    capacity, top_gate, chosen, gates_masked, mask, priority, l_aux, l_zloss = gate(x)
    np.testing.assert_array_equal(_sorted_rows(chosen.numpy()), _expected(balanced))
    assert top_gate.shape == [TOKENS, TOP_K] and top_gate.dtype == paddle.float32
    scores = paddle.nn.functional.softmax(x @ gate.weight, axis=-1).numpy()
    at = np.take_along_axis(scores, chosen.numpy(), axis=1)
    np.testing.assert_allclose(top_gate.numpy(), at / at.sum(1, keepdims=True), rtol=1e-5)
    (top_gate.sum() + l_aux).backward()
    assert float(gate.weight.grad.abs().sum()) > 0
    _assert_recorded(balanced)


# --------------------------------------------------------------------------- families that import with stubs


@pytest.fixture(scope="module")
def families(paddleformers_version):
    """The worker's findings, component on and off (one subprocess, about 15 s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("PADDLE_HYBRID_BALANCED_ROUTING", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "worker_paddleformers_families.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("on", [True, False], ids=["balanced", "stock"])
def test_family(families, family, on):
    found = families[family]["on" if on else "off"]
    np.testing.assert_array_equal(_sorted_rows(found["block_chosen"]), _expected(on))
    assert found["weights_match"], found  # the block's output / the router's weights, from the chosen experts
    assert found["gate_grad"] > 0
    assert found["weights_dtype"] == "paddle.float32"
    if on:  # the model's step: both MoE layers routed balanced, the last one recorded
        assert found["record"] == {"mode": "forced-balanced", "gate_calls": 2, "top_k": TOP_K,
                                   "tokens_per_expert": [5, 5, 5, 5]}
    else:
        assert found["record"] is None


# --------------------------------------------------------------------------- the dry run


def test_dry_run_of_a_paddleformers_moe_routes_balanced(tmp_path, paddleformers_version):
    """``python -m paddle_hybrid.dryrun`` (2 ranks, data parallel) of examples/paddleformers_trainer.py on its
    tiny GPT-OSS (2 experts, top-1; built from its config), 2 steps (the dry run measures the second): every
    rank's class says its PaddleFormers gates routed forced-balanced, 16 tokens a rank over 2 experts."""
    trainer = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "2", "PYTHONPATH": ROOT}
    write = subprocess.run([sys.executable, trainer, "write-tiny-model", str(tmp_path / "model"), "--family",
                            "gpt_oss"], env=env, capture_output=True, text=True, timeout=300)
    assert write.returncode == 0, write.stderr[-3000:]
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node", "2", "--ranks", "all",
         "--json", str(report), trainer, "--model_name_or_path", str(tmp_path / "model"), "--init_from_config", "true",
         "--output_dir", str(tmp_path / "out"), "--device", "cpu", "--bf16", "false", "--fp16", "false",
         "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none", "--max_steps", "2",
         "--per_device_train_batch_size", "1", "--seq_length", "16", "--num_samples", "16", "--save_strategy", "no"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(report.read_text())
    assert found["errors"] == [] and len(found["rank_classes"]) == 2
    for entry in found["rank_classes"]:  # one MoE layer a decoder layer, 2 layers, 2 steps: 4 gate calls
        assert entry["routing"] == {"mode": "forced-balanced", "gate_calls": 4, "top_k": 1, "tokens_per_expert": [8, 8]}


# --------------------------------------------------------------------------- another PaddleFormers


@pytest.mark.parametrize("version, warned, note", [("9.9.9", True, "PaddleFormers 9.9.9: its gates not covered"),
                                                   (None, False, "PaddleFormers not installed")])
def test_another_or_no_paddleformers_is_left_alone(plugin_restored, monkeypatch, version, warned, note):
    """Another PaddleFormers: a warning and a report line; none: a report line; either way the incubate
    gates are covered and nothing of PaddleFormers is patched or waited for."""
    from paddle_hybrid.dygraph.balanced_routing import COMPONENT, paddleformers_gates

    monkeypatch.setattr(paddleformers_gates, "paddleformers_version", lambda: version)
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_hybrid.install(dataclasses.replace(config, balanced_routing=True))
    assert COMPONENT.is_active() and note in COMPONENT.state.reason
    assert any("PaddleFormers' MoE gates are covered for PaddleFormers 1.2.x, this is 9.9.9" in str(w.message)
               for w in caught) == warned
    assert all(owner.__module__.startswith("paddle.incubate") for owner, _ in COMPONENT.patcher.patched())
