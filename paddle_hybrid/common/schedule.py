"""The order of a pipeline stage's forwards and backwards in one step: one vocabulary for the
static pipeline's runner (:mod:`paddle_hybrid.static.static_pipeline.schedule`) and the timeline's
ideal schedules (:mod:`paddle_hybrid.testing.ideal_timeline`).

Ops are ``("F", micro)`` and ``("B", micro)``.  Callers check their arguments (each with the
words of its own API); these functions only order.
"""
from __future__ import annotations

__all__ = ["FORWARD", "BACKWARD", "one_f_one_b", "f_then_b"]

FORWARD, BACKWARD = "F", "B"


def one_f_one_b(num_stages: int, num_micro: int, stage: int) -> list:
    """Fleet's non-interleaved 1F1B order of ``stage``: ``min(num_stages - stage - 1, num_micro)``
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards; a
    stage never holds more than ``num_stages - stage`` micro-batches' activations."""
    warmup = min(num_stages - stage - 1, num_micro)
    order = [(FORWARD, i) for i in range(warmup)]
    for k in range(num_micro - warmup):
        order += [(FORWARD, warmup + k), (BACKWARD, k)]
    order += [(BACKWARD, i) for i in range(num_micro - warmup, num_micro)]
    return order


def f_then_b(num_micro: int) -> list:
    """Every forward, then every backward."""
    return [(FORWARD, i) for i in range(num_micro)] + [(BACKWARD, i) for i in range(num_micro)]
