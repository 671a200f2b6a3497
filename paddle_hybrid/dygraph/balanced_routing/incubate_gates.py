"""Balanced forwards of Paddle's incubate MoE gates (``paddle.incubate.distributed.models.moe.gate``).

Each replaces its class's ``forward`` and keeps its contract (see the package docstring):

==============  =====================================================================
gate            balanced forward
==============  =====================================================================
``NaiveGate``   its projection's scores; experts round-robin; the scores at them
                (``return_all_scores``: also the scores)
``GShardGate``  as ``NaiveGate`` with k = 2; the load-balancing loss of that routing;
                its capacity limit (``limit_by_capacity``); no random second choice
``SwitchGate``  the softmax of its projection (no noise); one expert round-robin; its
                capacity limit; the load-balancing loss of what the limit kept
==============  =====================================================================
"""
from __future__ import annotations

import math

import numpy as np

from ...common import routing_record
from .round_robin import balanced_indices

__all__ = ["apply", "FORWARDS"]

GATE_MODULE = "paddle.incubate.distributed.models.moe.gate"
UTILS_MODULE = "paddle.incubate.distributed.models.moe.utils"


def _route(scores, top_k: int):
    """``(values, indices)``: the balanced experts of each row of ``scores`` and the scores at them."""
    import paddle

    chosen = balanced_indices(int(scores.shape[0]), top_k, int(scores.shape[-1]))
    indices = paddle.to_tensor(chosen, place=scores.place)
    return paddle.take_along_axis(scores, indices, axis=-1), indices


def _counts(indices, experts: int) -> np.ndarray:
    """Tokens routed to each expert; ``-1`` (dropped by a capacity limit) is not counted."""
    flat = indices.numpy().reshape(-1)
    return np.bincount(flat[flat >= 0], minlength=experts)[:experts]


def _note(indices, experts: int, top_k: int) -> np.ndarray:
    counts = _counts(indices, experts)
    routing_record.note("forced-balanced", counts.tolist(), top_k)
    return counts


def _balance_loss(probs, counts: np.ndarray):
    """The load-balancing loss of a routing: ``experts * sum(fraction routed * mean probability)``
    (1 for a balanced routing of uniform probabilities), differentiable in ``probs``."""
    import paddle

    fraction = paddle.to_tensor(counts / max(int(counts.sum()), 1), dtype=probs.dtype, place=probs.place)
    return (fraction * probs.mean(axis=0)).sum() * len(counts)


def _capacity_limited(gate, indices, tokens: int):
    """``indices`` after the gate's capacity limit, which exchanges the counts over its group as the
    gate's own forward does."""
    import importlib

    utils = importlib.import_module(UTILS_MODULE)
    capacity = math.ceil(gate.capacity[0 if gate.training else 1] * tokens)
    _, _, limited = utils.limit_by_capacity(indices, gate.num_expert, gate.world_size, capacity, group=gate.group)
    return limited


def naive_forward(self, inp, return_all_scores=False):
    scores = self.gate(inp)
    values, indices = _route(scores, self.top_k)
    _note(indices, self.tot_expert, self.top_k)
    if return_all_scores:
        return values, indices, scores
    return values, indices


def gshard_forward(self, x):
    import paddle.nn.functional as F

    scores = self.gate(x)
    values, indices = _route(scores, self.top_k)
    self.set_loss(_balance_loss(F.softmax(scores, axis=1), _counts(indices, self.tot_expert)))
    indices = _capacity_limited(self, indices, int(x.shape[0]))
    _note(indices, self.tot_expert, self.top_k)
    return values, indices


def switch_forward(self, inp):
    import paddle.nn.functional as F

    probs = F.softmax(self.gate(inp), axis=-1)
    values, indices = _route(probs, 1)
    indices = _capacity_limited(self, indices, int(inp.shape[0]))
    self.set_loss(_balance_loss(probs, _note(indices, self.tot_expert, 1)))
    return values, indices


# class -> (its forward's parameters, the balanced forward)
FORWARDS = {
    "NaiveGate": (["self", "inp", "return_all_scores"], naive_forward),
    "GShardGate": (["self", "x"], gshard_forward),
    "SwitchGate": (["self", "inp"], switch_forward),
}


def apply(config, patcher) -> None:
    import importlib

    gates = importlib.import_module(GATE_MODULE)
    patcher.require(importlib.import_module(UTILS_MODULE), "limit_by_capacity", UTILS_MODULE)
    classes = {name: patcher.require(gates, name, GATE_MODULE) for name in FORWARDS}
    for name, (params, _) in FORWARDS.items():
        patcher.check_params(classes[name].__dict__.get("forward"), params, f"{name}.forward")
    for name, (_, forward) in FORWARDS.items():
        patcher.set(classes[name], "forward", forward)
