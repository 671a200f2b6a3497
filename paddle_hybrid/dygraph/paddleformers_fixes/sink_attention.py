"""PaddleFormers 1.2's ``sdpa`` attention with attention sinks (GPT-OSS), computed on CPU.

GPT-OSS adds a learned logit per head (``sinks``) to every softmax row.  With
``_attn_implementation="sdpa"`` PaddleFormers hands such a call to ``sink_attention_forward``
(``nn/attention/sink_impl.py``), which is flash attention only: on a CPU build it stops at once on
``ValueError: Flag FLAGS_cudnn_deterministic cannot get its value through this function`` (a flag
only CUDA builds have), and a CPU tensor could not reach the flash kernels anyway.  Its ``eager``
implementation computes the same attention with plain operators and runs on CPU.

What this does: ``sdpa_attention``'s reference to ``sink_attention_forward`` is replaced by one that,
for a query on CPU, computes what the flash path computes, with operators that have CPU kernels
and Paddle's autograd for the backward: the scores ``q k^T * scale`` (GQA: each key/value head
serves ``heads / kv_heads`` query heads), the additive or boolean mask, the causal mask when asked
(a query row ``i`` sees keys ``j <= i + len_k - len_q``), the sink appended as one more column of
every row, a float32 softmax over the row, the sink column dropped, dropout on the rest, times
``v``.  That is the flash path's ``out * 1 / (1 + exp(sink - lse))`` written as one softmax, and
the eager implementation's formula.  Anything else (a query on a GPU or another device, a call with
``startend_row_indices``, which ``sdpa`` never makes) goes to PaddleFormers' function unchanged.

Checked (``tests/dygraph/paddleformers_fixes/test_sink_attention.py``): a tiny GPT-OSS (GQA,
sliding-window and full layers) gives the loss and every gradient of the eager implementation
within float32 rounding, with and without padding; the function alone against eager's, gradients
of q, k, v and the sinks included.  The family's tensor-parallel and pipeline refusals
(:mod:`.families`, :mod:`.pipe_models`) are unchanged; this lets an ``sdpa`` run start on CPU, and
was checked in one process (data parallel and sharding not tried with ``sdpa``).
"""
from __future__ import annotations

import functools

from ...registry.device import on_cpu

__all__ = ["MODULE", "PARAMS", "apply_to", "sink_attention"]

MODULE = "paddleformers.nn.attention.sdpa_attention"
# PaddleFormers 1.2's sink_attention_forward: what the replacement accepts and hands on.
PARAMS = ["q", "k", "v", "sink", "attention_mask", "startend_row_indices", "dropout_p", "softmax_scale", "causal"]


def sink_attention(q, k, v, sink, attention_mask=None, dropout_p=0.0, softmax_scale=None, causal=False):
    """Attention with a sink logit per head, from operators every device has.

    ``q``: ``[batch, len_q, heads, dim]``; ``k``, ``v``: ``[batch, len_k, kv_heads, dim]`` with
    ``heads`` a multiple of ``kv_heads``; ``sink``: ``[heads]``; ``attention_mask``: added to the
    scores (float) or keeping the positions that are True (bool), broadcast to
    ``[batch, heads, len_q, len_k]``; ``softmax_scale``: ``dim ** -0.5`` when None.  Returns
    ``[batch, len_q, heads, dim]`` in ``q``'s dtype.
    """
    import paddle
    import paddle.nn.functional as F

    batch, len_q, heads, dim = q.shape
    len_k, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads or sink.shape != [heads]:
        raise ValueError(f"sink attention: {heads} query heads, {kv_heads} key/value heads and sinks of shape "
                         f"{sink.shape}; the query heads must be a multiple of the key/value heads and the sinks "
                         f"one per query head")
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    # [b, l, h, d] -> [b, h, l, d], in float32: the softmax of a bf16/fp16 run keeps float32's range
    qh, kh, vh = (t.transpose([0, 2, 1, 3]).astype("float32") for t in (q, k, v))
    if heads != kv_heads:  # key/value head j serves query heads j * groups ... (j + 1) * groups - 1
        kh = paddle.repeat_interleave(kh, heads // kv_heads, axis=1)
        vh = paddle.repeat_interleave(vh, heads // kv_heads, axis=1)
    scores = paddle.matmul(qh, kh, transpose_y=True) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :len_k]
        if mask.dtype == paddle.bool:
            scores = paddle.where(mask, scores, paddle.full([], float("-inf"), scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    if causal:
        # the last query row is the last key: with a cache, len_k - len_q earlier keys are seen by every row
        seen = paddle.tril(paddle.ones([len_q, len_k], dtype="bool"), diagonal=len_k - len_q)
        scores = paddle.where(seen, scores, paddle.full([], float("-inf"), scores.dtype))
    # the sink column keeps every row's sum finite: a row with every key masked attends to the sink only
    sink_column = sink.astype("float32").reshape([1, heads, 1, 1]).expand([batch, heads, len_q, 1])
    probs = F.softmax(paddle.concat([scores, sink_column], axis=-1), axis=-1)[..., :-1]
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p, training=True)  # as PaddleFormers' sink path: always training
    return paddle.matmul(probs, vh).transpose([0, 2, 1, 3]).astype(q.dtype)


def _make_sink_attention_forward(original):
    @functools.wraps(original)
    def sink_attention_forward(q, k, v, sink, attention_mask=None, startend_row_indices=None, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        if startend_row_indices is not None or not on_cpu(q):
            return original(q, k, v, sink, attention_mask=attention_mask, startend_row_indices=startend_row_indices,
                            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal)
        return sink_attention(q, k, v, sink, attention_mask=attention_mask, dropout_p=dropout_p,
                              softmax_scale=softmax_scale, causal=causal)

    return sink_attention_forward


def apply_to(patcher, sdpa_attention) -> None:
    """Replace ``sink_attention_forward`` as PaddleFormers' ``sdpa_attention`` module (``MODULE``)
    calls it."""
    original = patcher.require(sdpa_attention, "sink_attention_forward", MODULE)
    patcher.check_params(original, PARAMS, f"{MODULE}.sink_attention_forward")
    patcher.set(sdpa_attention, "sink_attention_forward", _make_sink_attention_forward(original))
