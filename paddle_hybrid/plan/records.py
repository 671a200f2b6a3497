"""The kernels and collectives one microbatch runs on one rank, as records: what the step is priced from.

A record is ``Op(kind, phase, shape...)``:

* ``gemm`` ``(m, n, k, layout)``: a bf16 matrix product; a linear layer's forward is ``nn``, its input
  gradient ``nt`` and its weight gradient ``tn``;
* ``attention`` ``(bh, s, d)``: flash attention forward or backward (causal);
* ``memory`` ``(bytes,)``: a memory-bound kernel (norms, activations, dropout, residual adds, rotary,
  softmax, the loss), priced by the bytes it reads and writes;
* ``collective`` ``(op, bytes, axis)``: ``all_reduce``, ``all_gather``, ``reduce_scatter`` over the
  ``axis`` group (``tp``), ``bytes`` the whole tensor.

``phase`` is ``fwd``, ``bwd`` or ``recompute`` (the re-forward a recompute runs during backward).
The shapes are Megatron's and fleet's: a column-parallel QKV and FC1, a row-parallel projection and
FC2, tensor-parallel all-reduces after the row-parallel layers (with sequence parallelism an
all-gather before each column-parallel layer and a reduce-scatter after each row-parallel one).
Bytes of activations are bf16 (2 an element), dropout masks 1.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Op", "layer_ops", "embedding_ops", "head_ops"]

BF16 = 2


class Op(NamedTuple):
    kind: str
    phase: str
    shape: tuple
    what: str = ""


def _linear(ops, phase_fwd, m, n, k, what):
    """A linear layer ``[m, k] x [k, n]``: its forward in ``phase_fwd``; its two gradients in ``bwd``."""
    ops.append(Op("gemm", phase_fwd, (m, n, k, "nn"), what))
    if phase_fwd == "fwd":
        ops.append(Op("gemm", "bwd", (m, k, n, "nt"), what + ".dgrad"))
        ops.append(Op("gemm", "bwd", (k, n, m, "tn"), what + ".wgrad"))


def _attention_core(ops, phase, model, mbs, tp, backward):
    s, d = model.seq, model.head_dim
    bh = mbs * model.heads // tp
    if model.attention == "flash":
        ops.append(Op("attention", phase, (bh, s, d), "flash.fwd"))
        if backward:
            ops.append(Op("attention", "bwd", (bh, s, d), "flash.bwd"))
        return
    scores = bh * s * s
    ops.append(Op("gemm", phase, (bh * s, s, d, "nt"), "qk"))
    ops.append(Op("memory", phase, (scores * 2 * BF16,), "scale_mask_softmax"))
    if model.dropout:
        ops.append(Op("memory", phase, (scores * (2 * BF16 + 1),), "attention_dropout"))
    ops.append(Op("gemm", phase, (bh * s, d, s, "nn"), "av"))
    if backward:
        ops.append(Op("gemm", "bwd", (bh * s, s, d, "nt"), "av.dgrad"))
        ops.append(Op("gemm", "bwd", (bh * s, d, s, "tn"), "av.wgrad"))
        if model.dropout:
            ops.append(Op("memory", "bwd", (scores * (2 * BF16 + 1),), "attention_dropout.bwd"))
        ops.append(Op("memory", "bwd", (scores * 3 * BF16,), "softmax.bwd"))
        ops.append(Op("gemm", "bwd", (bh * s, d, s, "nn"), "qk.dgrad_q"))
        ops.append(Op("gemm", "bwd", (bh * s, d, s, "tn"), "qk.dgrad_k"))


def _tp_in(ops, phase, tokens, h, tp, sp, what):
    """What a column-parallel layer's input needs: SP's all-gather (forward) / reduce-scatter (backward); without
    SP the input gradient's all-reduce in backward.  A recompute pass repeats only the forward's all-gather."""
    if tp <= 1:
        return
    size = tokens * h * BF16
    if sp:
        ops.append(Op("collective", phase, ("all_gather", size, "tp"), what + ".gather"))
        if phase == "fwd":
            ops.append(Op("collective", "bwd", ("reduce_scatter", size, "tp"), what + ".dgrad_scatter"))
            ops.append(Op("collective", "bwd", ("all_gather", size, "tp"), what + ".wgrad_gather"))
    elif phase == "fwd":
        ops.append(Op("collective", "bwd", ("all_reduce", size, "tp"), what + ".dgrad_allreduce"))


def _tp_out(ops, phase, tokens, h, tp, sp, what):
    """After a row-parallel layer: all-reduce (reduce-scatter with SP) in forward; with SP an all-gather of the
    output gradient in backward.  A recompute pass repeats the forward's collective."""
    if tp <= 1:
        return
    size = tokens * h * BF16
    ops.append(Op("collective", phase, ("reduce_scatter" if sp else "all_reduce", size, "tp"), what + ".out"))
    if sp and phase == "fwd":
        ops.append(Op("collective", "bwd", ("all_gather", size, "tp"), what + ".out_grad_gather"))


def _elementwise(ops, phase, nbytes, what):
    ops.append(Op("memory", phase, (nbytes,), what))
    if phase == "fwd":
        ops.append(Op("memory", "bwd", (2 * nbytes,), what + ".bwd"))


def layer_ops(model, mbs: int, tp: int, sp: bool, recompute: str = "none") -> list:
    """The records of one transformer layer for one microbatch of ``mbs`` sequences on one tensor-parallel rank."""
    h, t = model.hidden, mbs * model.seq
    kv = model.kv_heads * model.head_dim
    local = t // tp if sp else t          # tokens a rank's norms, dropouts and residuals see
    ops = []
    passes = [("fwd", True)] + ([("recompute", False)] if recompute == "full" else [])
    for phase, first in passes:
        def lin(m, n, k, what):
            if first:
                _linear(ops, "fwd", m, n, k, what)
            else:
                ops.append(Op("gemm", phase, (m, n, k, "nn"), what))

        def elem(nbytes, what):
            if first:
                _elementwise(ops, "fwd", nbytes, what)
            else:
                ops.append(Op("memory", phase, (nbytes,), what))

        # ---- attention block
        elem(local * h * 2 * BF16, "norm1")
        _tp_in(ops, phase, t, h, tp, sp, "qkv")
        lin(t, (h + 2 * kv) // tp, h, "qkv")
        if model.rmsnorm:  # rotary on q and k
            elem(t * (h + kv) // tp * 2 * BF16, "rotary")
        _attention_core(ops, phase, model, mbs, tp, backward=first)
        if first and recompute == "sel":
            _attention_core(ops, "recompute", model, mbs, tp, backward=False)
        lin(t, h, h // tp, "proj")
        _tp_out(ops, phase, t, h, tp, sp, "proj")
        elem(local * h * (3 * BF16 + (1 if model.dropout else 0)), "residual1")
        # ---- MLP block
        elem(local * h * 2 * BF16, "norm2")
        _tp_in(ops, phase, t, h, tp, sp, "fc1")
        lin(t, (2 if model.gated else 1) * model.ffn // tp, h, "fc1")
        elem(t * model.ffn // tp * ((3 if model.gated else 2) * BF16), "activation")
        lin(t, h, model.ffn // tp, "fc2")
        _tp_out(ops, phase, t, h, tp, sp, "fc2")
        elem(local * h * (3 * BF16 + (1 if model.dropout else 0)), "residual2")
    return ops


def embedding_ops(model, mbs: int, tp: int, sp: bool) -> list:
    """The first stage's embedding lookup (vocabulary-parallel under tp) for one microbatch."""
    t, h = mbs * model.seq, model.hidden
    ops = [Op("memory", "fwd", (t * h * 2 * BF16,), "embedding"), Op("memory", "bwd", (t * h * (BF16 + 8),),
                                                                     "embedding.bwd")]
    if tp > 1:
        ops.append(Op("collective", "fwd", ("reduce_scatter" if sp else "all_reduce", t * h * BF16, "tp"),
                      "embedding.out"))
    return ops


def head_ops(model, mbs: int, tp: int, sp: bool) -> list:
    """The last stage's final norm, LM head (vocabulary-parallel) and cross-entropy loss for one microbatch."""
    t, h = mbs * model.seq, model.hidden
    local = t // tp if sp else t
    ops = []
    _elementwise(ops, "fwd", local * h * 2 * BF16, "final_norm")
    _tp_in(ops, "fwd", t, h, tp, sp, "lm_head")
    _linear(ops, "fwd", t, model.vocab // tp, h, "lm_head")
    # fp32 softmax cross-entropy over the rank's vocabulary slice: read logits, write and read fp32 values
    ops.append(Op("memory", "fwd", (t * model.vocab // tp * (BF16 + 8),), "cross_entropy"))
    ops.append(Op("memory", "bwd", (t * model.vocab // tp * (4 + BF16),), "cross_entropy.bwd"))
    return ops
