"""ERNIE-4.5-MoE with its experts over the tensor-parallel group and no sequence parallelism: refused
(every device), because it trains wrong.

With ``moe_group`` "mp" (PaddleFormers' default for ERNIE-4.5-MoE) and ``tensor_model_parallel_size``
above 1, ``Ernie4_5_MoeModel`` turns the FFN's tensor parallelism off and spreads the experts over the
TP ranks.  Its MoE block (``MOEAllGatherLayerV2``) all-gathers the tokens of every rank of that group
before routing them: under sequence parallelism each rank holds its own part of the sequence, so
every token is routed once.  Without it every TP rank holds the same tokens, and each is routed once
per TP rank.  The losses still equal one process's, but the step-1 gradients differ (4.1e-2 of the
largest at TP2, 1 x 2 CPU ranks, `tests/dygraph/paddleformers_fixes/test_ernie_moe_cpu.py`'s model).
PaddleFormers' own pipeline model asserts sequence parallelism for this group.

Refused when the model is built (``Ernie4_5_MoeModel.__init__``), before anything is trained,
naming ``--sequence_parallel true`` and the other way out (``moe_group`` "dp" or "dummy" in the
configuration).
"""
from __future__ import annotations

import functools

from .moe_dispatcher import ExpertParallelRefused

__all__ = ["ERNIE_MOE_MODULE", "apply", "check"]

ERNIE_MOE_MODULE = "paddleformers.transformers.ernie4_5_moe.modeling"
_TP_GROUPS = {"mp", "model", "tp"}  # the names PaddleFormers reads as the tensor-parallel group


def check(config) -> None:
    """Raise :class:`ExpertParallelRefused` for a configuration whose experts route every token once per
    TP rank (see the module docstring)."""
    group = getattr(config, "moe_group", None)
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    experts = getattr(config, "moe_num_experts", 0) or 0
    experts = sum(experts) if isinstance(experts, (list, tuple)) else experts
    if isinstance(group, str) and group in _TP_GROUPS and tp > 1 and experts and not config.sequence_parallel:
        raise ExpertParallelRefused(
            f"paddle_hybrid: ERNIE-4.5-MoE with moe_group {group!r} at tensor_model_parallel_size {tp} without "
            "sequence parallelism trains wrong: every TP rank holds the same tokens and its MoE block gathers "
            f"them from all {tp}, so each token is routed {tp} times (losses as one process's, gradients not). "
            "Give --sequence_parallel true (each rank then routes its own part of the sequence), or set "
            "moe_group to \"dp\" or \"dummy\" in the model's config.json.")


def _make_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        check(config)
        return original(self, config, *args, **kwargs)

    return __init__


def apply(patcher, modeling) -> None:
    """``Ernie4_5_MoeModel.__init__`` checks its configuration first."""
    cls = patcher.require(modeling, "Ernie4_5_MoeModel", ERNIE_MOE_MODULE)
    original = patcher.require(cls, "__init__", f"{ERNIE_MOE_MODULE}.Ernie4_5_MoeModel")
    patcher.check_params(original, ["self", "config"], f"{ERNIE_MOE_MODULE}.Ernie4_5_MoeModel.__init__")
    patcher.set(cls, "__init__", _make_init(original))
