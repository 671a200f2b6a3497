"""A rank's microbatch priced from the kernels its dry run recorded (the probe's ``kernels``:
:mod:`paddle_hybrid.dygraph.dryrun_probe.kernels`), instead of from a decoder's shapes (:mod:`.records`).

Each recorded forward call is priced as the GPU job runs it, and its backward derived from it:

* ``matmul`` / ``linear``: a bf16 GEMM ``[M, K] x [K, N]`` (leading dimensions folded into M; a transposed operand
  picks the table's layout); in backward the input gradient (``nt``) where the first operand needs one and the
  weight gradient (``tn``) where the second does;
* a fused attention kernel (``flash_attn``...): the attention table's forward and backward;
* any other op: memory-bound, by the bytes of its tensors in and out (float32 ones as bf16: the job's
  activations), twice that in backward where an input needs a gradient.

A backward exists only where the call ran with gradients enabled (recompute's first, gradient-free forward has
none; its re-forward inside backward has).  Calls inside the optimizer's step are left to the optimizer's own
price.  With ``attention="flash"`` a script that computes attention as ``matmul + softmax`` on the CPU (what
PaddleFormers' sdpa path does there) is priced with the GPU job's fused kernel: the two matmuls of a
``[.., s, s]`` score matrix and the ops on it become one flash attention call.
"""
from __future__ import annotations

import math

__all__ = ["price_microbatch", "gemm_flops"]

_GPU_BYTES = {"float32": 2, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "bool": 1,
              "uint8": 1, "int8": 1}
_ATTENTION = ("flash_attn", "flash_attn_unpadded", "flashmask_attention", "memory_efficient_attention")


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _gemm_shape(rec):
    """(M, N, K, layout) of a recorded matmul / linear."""
    x, y = rec["shapes"][0], rec["shapes"][1]
    if rec["op"] == "linear":  # x [..., K] @ w [K, N]
        return _numel(x[:-1]), y[1], x[-1], "nn"
    tx, ty = (rec["attrs"] + [False, False])[:2]
    m, k = (x[-1], x[-2]) if tx else (x[-2], x[-1])
    n = y[-2] if ty else y[-1]
    batch = _numel(x[:-2]) if len(x) > 2 else 1
    return batch * m, n, k, ("nt" if ty else ("tn" if tx else "nn"))


def gemm_flops(rec) -> int:
    m, n, k, _ = _gemm_shape(rec)
    return 2 * m * n * k


def _square_scores(rec) -> bool:
    """A call on an attention score matrix ``[.., s, s]`` (its first tensor, or its output)."""
    shapes = rec["shapes"][:1] + rec["out_shapes"][:1]
    return any(len(s) >= 4 and s[-1] == s[-2] > 1 for s in shapes)


def _bytes(rec) -> int:
    total = 0
    for shape, dtype in zip(rec["shapes"], rec["dtypes"]):
        total += _numel(shape) * _GPU_BYTES.get(dtype, 4)
    out_dtype = rec["dtypes"][0] if rec["dtypes"] else "float32"
    total += sum(_numel(s) for s in rec["out_shapes"]) * _GPU_BYTES.get(out_dtype, 4)
    return total


def price_microbatch(kernels: list, microbatches: int, tables, launch_s: float = 0.0, attention: str = "recorded",
                     attention_backend: str = "flash") -> dict:
    """``{"fwd_s", "bwd_s", "gemm_flops", "records"}`` of one microbatch (the step's calls over ``microbatches``):
    forward and backward seconds (recompute's re-forward in backward)."""
    fwd = bwd = 0.0
    flops = 0
    per = 1.0 / max(microbatches, 1)
    flash = attention == "flash"
    for rec in kernels:
        if rec["phase"] == "update":
            continue
        calls = rec["calls"] * per
        backward = rec["grad_enabled"] and any(rec["needs_grad"])
        op = rec["op"]
        if flash and op in ("matmul", "bmm") and len(rec["shapes"][0]) >= 4:
            x = rec["shapes"][0]
            if x[-1] == x[-2] > 1:
                continue  # probabilities @ V: part of the fused kernel priced at the scores' matmul
            if rec["out_shapes"] and rec["out_shapes"][0][-1] == rec["out_shapes"][0][-2] > 1:
                b_h, s, d = _numel(x[:-2]), x[-2], x[-1]
                f_s, b_s = tables.attention(b_h, s, d, causal=True, backend=attention_backend)
                t_f, t_b = max(f_s, launch_s), max(b_s, launch_s)
                fwd, bwd = (fwd, bwd + calls * t_f) if rec["phase"] == "recompute" else (fwd + calls * t_f, bwd)
                bwd += calls * t_b if backward else 0.0
                flops += int(calls * 4 * b_h * s * s * d)
                continue
        if flash and op not in ("matmul", "linear", "bmm", "mm") and _square_scores(rec):
            continue  # softmax, mask, dropout of the scores: inside the fused kernel
        if op in ("matmul", "linear", "bmm", "mm"):
            m, n, k, layout = _gemm_shape(rec)
            t_f = max(tables.gemm(m, n, k, layout), launch_s)
            t_b = 0.0
            if backward and rec["needs_grad"][0]:
                t_b += max(tables.gemm(m, k, n, "nt"), launch_s)
            if backward and len(rec["needs_grad"]) > 1 and rec["needs_grad"][1]:
                t_b += max(tables.gemm(k, n, m, "tn"), launch_s)
            flops += int(calls * 2 * m * n * k)
        elif op in _ATTENTION:
            q = rec["shapes"][0]  # [b, s, heads, d]
            t_f, t_b = tables.attention(q[0] * q[2], q[1], q[3], causal=True, backend=attention_backend)
            t_f, t_b = max(t_f, launch_s), (max(t_b, launch_s) if backward else 0.0)
        else:
            t_f = max(tables.memory_bound(_bytes(rec)), launch_s)
            t_b = max(tables.memory_bound(2 * _bytes(rec)), launch_s) if backward else 0.0
        if rec["phase"] == "recompute":
            bwd += calls * (t_f + t_b)
        else:
            fwd += calls * t_f
            bwd += calls * t_b
    return {"fwd_s": fwd, "bwd_s": bwd, "gemm_flops": flops, "records": len(kernels)}
