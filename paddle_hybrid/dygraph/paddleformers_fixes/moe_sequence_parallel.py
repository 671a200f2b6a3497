"""PaddleFormers 1.2's MoE models under tensor parallelism with sequence parallelism: two weights held
whole by every tensor-parallel rank get only that rank's part of their gradient.

Under sequence parallelism each tensor-parallel rank holds a part of the sequence between the
attention and MLP blocks; a weight applied there (a norm's scale) gets, on each rank, the gradient of
its part only.  PaddleFormers marks such weights (``mark_as_sequence_parallel_parameter``) and the
Trainer sums their gradients over the tensor-parallel group before the optimizer step
(``SPGradSyncCallback``, or hooks with sharding stage 2/3).  Two are not marked:

* **Qwen3-MoE's final norm** (``Qwen3MoeModel.norm``, ``transformers/qwen3_moe/modeling.py``): built
  without ``input_is_parallel=config.sequence_parallel``, which every other family of PaddleFormers
  1.2 passes for its final norm (LLaMA, Qwen2, Qwen3, Qwen2-MoE, GLM4-MoE, ERNIE-4.5, DeepSeek-V3,
  ...).  ``python -m paddle_hybrid.verify --layouts sp2`` on a tiny Qwen3-MoE (no expert parallelism):
  ``model.norm.weight``'s step-1 gradient 0.72 of its largest element off one process, and, through
  the global norm of the clipping, every weight a little off and different between the two ranks.
* **The gate of ``ModularMoELayer`` under expert parallelism** (``nn/moe_deepep/modular_moe_layer.py``;
  Qwen3-MoE, GLM4-MoE with ``use_unified_moe``): with EP > 1 the layer does not gather the sequence
  (it dispatches each rank's own tokens to the experts), so its gate's weight sees this rank's tokens
  only; it is neither marked nor otherwise reduced, and the ranks' gates drift apart from step 1.
  (Without expert parallelism the layer gathers the sequence first, and the gate sees every token.)

Fixed on every device: the two weights are marked as sequence-parallel parameters when the model is
built with ``sequence_parallel`` (the gate: and EP > 1 and tensor parallelism), so the Trainer's own
sum over the tensor-parallel group reaches them.  Nothing else changes; without sequence parallelism
nothing is marked.
"""
from __future__ import annotations

import functools

__all__ = ["QWEN3_MOE_MODULE", "apply_to_qwen3_moe", "apply_to_modular"]

QWEN3_MOE_MODULE = "paddleformers.transformers.qwen3_moe.modeling"


def mark_trained(weights) -> None:
    """Mark each trained weight of ``weights`` sequence-parallel: its gradient is summed over the TP group
    (a weight held whole by every rank that sees only this rank's part of the tokens)."""
    from paddle.distributed.fleet.utils.sequence_parallel_utils import mark_as_sequence_parallel_parameter

    for weight in weights:
        if not weight.stop_gradient:
            mark_as_sequence_parallel_parameter(weight)


def _make_model_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        if getattr(config, "sequence_parallel", False):
            self.norm.enable_sequence_parallel()

    return __init__


def apply_to_qwen3_moe(patcher, modeling) -> None:
    """``Qwen3MoeModel``: its final norm marked under sequence parallelism."""
    cls = patcher.require(modeling, "Qwen3MoeModel", QWEN3_MOE_MODULE)
    original = patcher.require(cls, "__init__", f"{QWEN3_MOE_MODULE}.Qwen3MoeModel")
    patcher.check_params(original, ["self", "config"], f"{QWEN3_MOE_MODULE}.Qwen3MoeModel.__init__")
    patcher.set(cls, "__init__", _make_model_init(original))


def _make_modular_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.sequence_parallel and self.tensor_model_parallel_size > 1 and self.expert_model_parallel_size > 1:
            mark_trained(self.gate.parameters())

    return __init__


def apply_to_modular(patcher, modular) -> None:
    """``ModularMoELayer`` under EP > 1 with sequence parallelism: its gate's weights marked."""
    from .moe_dispatcher import MODULAR_MODULE

    cls = patcher.require(modular, "ModularMoELayer", MODULAR_MODULE)
    original = patcher.require(cls, "__init__", f"{MODULAR_MODULE}.ModularMoELayer")
    patcher.set(cls, "__init__", _make_modular_init(original))
