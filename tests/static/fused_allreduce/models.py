"""Small legacy-IR static models for the fused all-reduce tests and benchmark.

In Paddle 3.3.1 ``paddle.matmul`` and ``F.gelu`` no longer accept legacy
Variables, so those two ops are appended with ``LayerHelper``.
"""
from __future__ import annotations

import numpy as np
import paddle
from paddle.base.layer_helper import LayerHelper


def matmul(x, y, transpose_y=False):
    helper = LayerHelper("matmul_v2")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(
        type="matmul_v2",
        inputs={"X": [x], "Y": [y]},
        outputs={"Out": [out]},
        attrs={"trans_x": False, "trans_y": transpose_y},
    )
    return out


def gelu(x):
    helper = LayerHelper("gelu")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(type="gelu", inputs={"X": [x]}, outputs={"Out": [out]}, attrs={"approximate": False})
    return out


def mlp(x, hidden=32, depth=3, out_dim=4):
    h = x
    for _ in range(depth - 1):
        h = paddle.nn.functional.relu(paddle.nn.Linear(h.shape[-1], hidden)(h))
    return paddle.nn.Linear(hidden, out_dim)(h)


def transformer_block(x, d_model=16, ffn=32):
    """Pre-LN block, single-head attention: x + attn(LN(x)); then + FFN(LN(.)).

    ``x`` is [batch, seq, d_model].  Single head: Paddle 3.3.1's legacy->PIR
    translator mis-translates the backward of a second ``reshape2`` here (it
    turns its XShape into a feed), so the block avoids head reshapes.
    """
    d = x.shape[-1]
    h = paddle.nn.LayerNorm(d)(x)
    q, k, v = paddle.split(paddle.nn.Linear(d, 3 * d)(h), 3, axis=-1)
    att = paddle.nn.functional.softmax(paddle.scale(matmul(q, k, transpose_y=True), 1.0 / np.sqrt(d)))
    x = x + paddle.nn.Linear(d, d)(matmul(att, v))
    h = paddle.nn.LayerNorm(d)(x)
    x = x + paddle.nn.Linear(ffn, d)(gelu(paddle.nn.Linear(d, ffn)(h)))
    return x


def build(kind: str, batch: int, **kw):
    """Returns (x, y, loss) in the current program: kind 'mlp' or 'tfm'."""
    if kind == "mlp":
        x = paddle.static.data("x", [batch, 16], "float32")
        y = paddle.static.data("y", [batch, 4], "float32")
        out = mlp(x, **kw)
    elif kind == "tfm":
        x = paddle.static.data("x", [batch, 8, 16], "float32")
        y = paddle.static.data("y", [batch, 8, 16], "float32")
        out = transformer_block(x, **kw)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    loss = paddle.mean(paddle.square(out - y))
    return x, y, loss


def data(kind: str, global_batch: int, steps: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    shape_x = [global_batch, 16] if kind == "mlp" else [global_batch, 8, 16]
    shape_y = [global_batch, 4] if kind == "mlp" else [global_batch, 8, 16]
    return [
        (rng.standard_normal(shape_x).astype("float32"), rng.standard_normal(shape_y).astype("float32"))
        for _ in range(steps)
    ]
