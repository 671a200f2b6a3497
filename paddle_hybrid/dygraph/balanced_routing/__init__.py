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

What a balanced gate keeps of its gate (:mod:`.incubate_gates`): the gate's own projection runs,
so its weight is trained and its activations are the real shapes; the combine weights are its
scores at the chosen experts (shape ``[tokens, k]``, the scores' dtype, differentiable); the
auxiliary loss is the load-balancing loss of the chosen routing (a 0-d float tensor, set as the
gate sets it); a capacity limit is applied as the gate applies it, with the same count exchange.
What it leaves out: the randomness that would unbalance a step (GShard's random second choice,
Switch's noise).

Covered: Paddle's incubate ``NaiveGate``, ``GShardGate`` and ``SwitchGate`` (``MoELayer``'s gates,
by class, so a gate built from a config dict is covered too); a gate subclass with a forward of
its own is not.  PaddleFormers' MoE gates are not covered.
"""
from __future__ import annotations

from ...registry.component import Component
from . import incubate_gates
from .round_robin import balanced_indices

__all__ = ["COMPONENT", "apply", "balanced_indices"]


def apply(config, patcher) -> str:
    incubate_gates.apply(config, patcher)
    return "MoE gates route round-robin, balanced (Paddle's NaiveGate, GShardGate, SwitchGate)"


COMPONENT = Component("balanced_routing", ("3.2.", "3.3."), "balanced_routing", apply)
