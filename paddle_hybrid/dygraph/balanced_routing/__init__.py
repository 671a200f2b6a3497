"""Forced-balanced MoE routing: every gate sends token ``t`` of its batch to experts
``(t * k + i) mod E`` for ``i < k``, so every expert gets the same number of tokens within one and
every rank, routing a batch of the same size, sends the same counts as every other.

Why: the dry run (``python -m paddle_hybrid.dryrun``) steps one rank in a fake world whose
all-to-all has no peer, so how many tokens each expert would receive is not known from the
model's own gate; a trained gate's load depends on data and weights the dry run does not have.
The dry run measures a balanced step instead, deterministically, and says so (the probe's
``routing`` field).  ``python -m paddle_hybrid.dryrun`` switches this on for every rank it runs;
a real run switched on the same way (``PADDLE_HYBRID_BALANCED_ROUTING=1``) is the one it stands
for, rank for rank.

What a balanced gate keeps of its gate (:mod:`.incubate_gates`, :mod:`.paddleformers_gates`): the
gate's own projection runs, so its weight is trained and its activations are the real shapes; the
combine weights are its scores at the chosen experts, normalized as the gate normalizes them
(shape ``[tokens, k]``, the scores' dtype, differentiable); the auxiliary loss is the
load-balancing loss of the chosen routing (a 0-d float tensor, set as the gate sets it; a
PaddleFormers gate computes its own over the chosen experts); a capacity limit is applied as the
gate applies it, with the same count exchange.  What it leaves out: the randomness that would
unbalance a step (GShard's random second choice, Switch's noise).

Covered: Paddle's incubate ``NaiveGate``, ``GShardGate`` and ``SwitchGate`` (``MoELayer``'s gates,
by class, so a gate built from a config dict is covered too); a gate subclass with a forward of
its own is not.  PaddleFormers 1.2's MoE gates (:mod:`.paddleformers_gates`), patched where each
chooses its experts, so the rest of the gate runs as written over the balanced choice: the top-k
choosers of ``PretrainedMoEGate`` and of the modular MoE layer's gate (DeepSeek-V3 and GLM4-MoE
under expert parallelism, Qwen3-MoE and GLM4-MoE through the modular layer), the routers of
DeepSeek-V3 and GLM4-MoE (``get_topk_indices``), and the ``topk`` inside Qwen2-MoE's and
Qwen3-MoE's sparse MoE blocks and GPT-OSS's router (and their auxiliary
``load_balancing_loss_func``); each waits for its module's import, with PaddleFormers 1.2 only
(another version: a warning, PaddleFormers untouched).  Of these only GPT-OSS's module imports on
CPU with PaddleFormers 1.2 (the others need the GPU-only paddlefleet / paddlefleet_ops); Qwen2-MoE's,
Qwen3-MoE's and GLM4-MoE's ``...ForCausalLM`` are paddlefleet's ``GPTModel`` (its routing is not
covered), their PaddleFormers models the ``...Deprecated`` classes.  Not covered: ERNIE-4.5-MoE (its gate
chooses and dispatches in fused GPU kernels, it does not step on CPU), PaddleFormers'
auto-parallel gate, and families with routers of their own (Qwen3-VL-MoE, ...).
"""
from __future__ import annotations

from ...registry.component import Component
from . import incubate_gates, paddleformers_gates
from .round_robin import balanced_indices

__all__ = ["COMPONENT", "apply", "balanced_indices"]


def apply(config, patcher) -> str:
    incubate_gates.apply(config, patcher)
    paddleformers = paddleformers_gates.apply(config, patcher)
    return f"MoE gates route round-robin, balanced (Paddle's NaiveGate, GShardGate, SwitchGate; {paddleformers})"


COMPONENT = Component("balanced_routing", ("3.2.", "3.3."), "balanced_routing", apply)
