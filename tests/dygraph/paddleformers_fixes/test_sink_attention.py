"""GPT-OSS with ``sdpa`` attention in one process on CPU (``paddleformers_fixes.sink_attention``):
PaddleFormers' sink attention is flash attention only and stopped on
``ValueError: Flag FLAGS_cudnn_deterministic cannot get its value through this function``; now it
computes on CPU what the eager implementation computes, checked against it on the same weights and
inputs.  Tolerance: rtol = 1e-5, atol = 1e-6, room for float32 sums taken in another order (both
compute scores, mask, softmax with the sink column, times v in float32; seen bitwise equal here).
Seen failing first: with the hook not yet installed, the four comparisons stopped on that flag.
The model comparison also fails with the causal flag ignored or the sinks left out (tried by hand)."""
import numpy as np
import pytest

import paddle

from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture)

RTOL, ATOL = 1e-5, 1e-6


def _tiny_gpt_oss():
    """2 layers (one sliding-window, one full), GQA (4 query heads on 2 key/value heads), random init."""
    from paddleformers.transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                          hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                          num_key_value_heads=2, sliding_window=4, max_position_embeddings=64, rope_scaling=None,
                          pad_token_id=None, fuse_rms_norm=False, dtype="float32")
    assert config.layer_types == ["sliding_attention", "full_attention"]
    paddle.seed(7)
    return GptOssForCausalLM(config)


def _loss_and_grads(model, implementation, batch):
    """One forward and backward with ``implementation`` (the attention is looked up per forward)."""
    model.config._attn_implementation = implementation
    model.clear_gradients()
    out = model(**batch)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    return float(loss), {p.name: p.grad.numpy().copy() for p in model.parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "right-padding"])
def test_gpt_oss_sdpa_gives_eager_loss_and_gradients(paddleformers_version, padded):
    model = _tiny_gpt_oss()
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, 128, size=(2, 12)), dtype="int64")
    batch = {"input_ids": ids, "labels": ids}
    if padded:  # the second sequence ends after 7 tokens: the full layer gets a mask too
        batch["attention_mask"] = paddle.to_tensor(np.array([[1] * 12, [1] * 7 + [0] * 5]), dtype="int64")
    sdpa_loss, sdpa_grads = _loss_and_grads(model, "sdpa", batch)  # stopped on the flag before the fix
    eager_loss, eager_grads = _loss_and_grads(model, "eager", batch)
    np.testing.assert_allclose(sdpa_loss, eager_loss, rtol=RTOL, atol=ATOL)
    assert sdpa_grads.keys() == eager_grads.keys()
    sinks = [layer.self_attn.sinks.name for layer in model.model.layers]
    assert all(np.abs(sdpa_grads[name]).max() > 0 for name in sinks)  # the sinks learn
    for name, grad in sdpa_grads.items():
        np.testing.assert_allclose(grad, eager_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)


def _attention_inputs(len_q=6, len_k=6):
    rng = np.random.default_rng(1)

    def tensor(*shape):
        t = paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
        t.stop_gradient = False
        return t

    # PaddleFormers' layout at the attention call: [batch, heads, len, dim]
    return tensor(2, 4, len_q, 8), tensor(2, 2, len_k, 8), tensor(2, 2, len_k, 8), tensor(4)


def _grads(out, tensors):
    return [g.numpy() for g in paddle.grad((out * out).sum(), tensors)]


@pytest.mark.parametrize("masked", [False, True], ids=["causal-flag", "additive-mask"])
def test_function_matches_eager_attention_with_its_gradients(paddleformers_version, masked):
    """``sdpa_attention_forward`` with a sink (the patched path) against ``eager_attention_forward``:
    the causal flag (``sdpa`` with no mask) against eager's explicit causal mask, and an additive
    mask (causal, one key hidden) given to both; outputs and the gradients of q, k, v and the sinks."""
    import types

    from paddleformers.nn.attention.eager_attention import eager_attention_forward
    from paddleformers.nn.attention.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(training=True, num_key_value_groups=2, is_causal=True)
    q, k, v, sink = _attention_inputs()
    causal = np.triu(np.full((6, 6), -1e6, dtype="float32"), k=1)
    if masked:
        causal[:, 2] = -1e6  # nobody sees key 2 (row 0 then sees the sink only)
        causal[0, 0] = -1e6
    mask = paddle.to_tensor(causal[None, None])
    got, _ = sdpa_attention_forward(module, q, k, v, attention_mask=mask if masked else None, sink=sink,
                                    scaling=8 ** -0.5)
    want, _ = eager_attention_forward(module, q, k, v, attention_mask=mask, sink=sink, scaling=8 ** -0.5)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL)
    for a, b, name in zip(_grads(got, [q, k, v, sink]), _grads(want, [q, k, v, sink]), "qkv" + "s"):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)


def test_patch_is_undone_with_its_patcher(paddleformers_version):
    from paddleformers.nn.attention import sdpa_attention

    from paddle_hybrid.dygraph.paddleformers_fixes import sink_attention
    from paddle_hybrid.registry.patching import Patcher

    installed = sdpa_attention.sink_attention_forward
    patcher = Patcher("test", "off")
    sink_attention.apply_to(patcher, sdpa_attention)
    assert sdpa_attention.sink_attention_forward is not installed
    patcher.revert()
    assert sdpa_attention.sink_attention_forward is installed
