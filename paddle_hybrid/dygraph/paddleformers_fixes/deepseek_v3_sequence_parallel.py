"""PaddleFormers 1.2's DeepSeek-V3 (and the Flex token layer) under tensor parallelism with sequence
parallelism: two gradients that miss the other tensor-parallel ranks' part.

Under sequence parallelism each tensor-parallel rank holds a part of the tokens between the blocks;
what it computes from the whole sequence must send the gradient of the other ranks' heads back to the
rank holding each token (a reduce-scatter), and a weight held whole by every rank that sees only its
part of the tokens must have its gradient summed over the ranks (``mark_as_sequence_parallel_parameter``;
the Trainer sums marked weights' gradients).  Two places do not:

* **DeepSeek-V3's rotary key** (``DeepseekV3Attention.forward``, ``transformers/deepseek_v3/modeling.py``):
  ``k_pe``, the rotary part of ``kv_a_proj_with_mqa``'s output computed on this rank's tokens, is
  gathered over the sequence with ``GatherOp`` (forward all-gather, backward *scatter*: this rank
  keeps its own tokens' rows of its own gradient) and shared by this rank's heads only.  The
  gradient a token's ``k_pe`` gets from the other ranks' heads is dropped, so ``kv_a_proj_with_mqa``,
  its layer's inputs and everything before train on a part of their gradient.  The query and the
  rest of the key/value go through PaddleFormers' sequence-parallel column linears, whose gather
  reduce-scatters the gradient; ``k_pe`` needs the same (``AllGatherOp``).
  ``python -m paddle_hybrid.verify --layouts sp2`` on a tiny DeepSeek-V3 (``examples/paddleformers_trainer.py
  write-tiny-model --family deepseek_v3``): step-1 gradients of ``kv_a_proj_with_mqa`` 0.53 of their
  largest element off one process, the embedding's 0.25.
* **The gate of the Flex token layer under expert parallelism** (``MoEFlexTokenLayer``,
  ``transformers/moe_layer.py``: DeepSeek-V3's ``DeepseekV3MoEFlexToken``, GLM4-MoE's ``Glm4MoeFlexMoE``):
  with EP > 1 over the tensor-parallel ranks and sequence parallelism the layer routes each rank's own
  tokens, so its gate's weight sees this rank's tokens only; it is not marked, and the ranks' gates
  drift apart from step 1 (the tiny DeepSeek-V3, ``--layouts sp2ep2``: its step-1 gradient 0.97 of its
  largest element off).  As :mod:`.moe_sequence_parallel` does for the modular layer's gate.

* **DeepSeek-V3's own MoE block without expert parallelism** (``DeepseekV3MoE``): under tensor
  parallelism with sequence parallelism it runs its routed experts (built with
  ``tensor_model_parallel_size`` 1, whole on every rank) and its router on this rank's tokens, and none
  of their weights is marked (``--layouts sp2``: the experts' step-1 gradients about their own size
  off).  The shared experts are PaddleFormers' sequence-parallel linears and need nothing.

Fixed on every device: ``k_pe``'s gather is ``AllGatherOp`` (the gather used inside
``DeepseekV3Attention.forward`` only; the model's other ``GatherOp`` stays); the Flex layer's
trained gate weights are marked sequence-parallel when EP > 1, TP > 1 and sequence parallelism; and
``DeepseekV3MoE``'s routed experts' and router's trained weights are marked when TP > 1 and sequence
parallelism.  Nothing changes without sequence parallelism.
"""
from __future__ import annotations

import contextvars
import functools

from .moe_sequence_parallel import mark_trained

__all__ = ["DEEPSEEK_V3_MODULE", "FLEX_LAYER_MODULE", "apply_to_deepseek_v3", "apply_to_flex_layer"]

DEEPSEEK_V3_MODULE = "paddleformers.transformers.deepseek_v3.modeling"
FLEX_LAYER_MODULE = "paddleformers.transformers.moe_layer"

_IN_ATTENTION = contextvars.ContextVar("paddle_hybrid_deepseek_v3_attention", default=False)


def _make_gather(stock_gather):
    """``GatherOp`` as ``deepseek_v3.modeling`` calls it: ``AllGatherOp`` inside the attention's forward."""

    class GatherOp:  # noqa: D401  (stands where the module's GatherOp is looked up)
        """PaddleFormers' ``GatherOp``, except inside ``DeepseekV3Attention.forward`` (``k_pe``): there
        ``AllGatherOp``, whose backward reduce-scatters (paddle_hybrid.paddleformers_fixes.deepseek_v3_sequence_parallel)."""

        @staticmethod
        def apply(*args, **kwargs):
            if _IN_ATTENTION.get():
                from paddle.distributed.fleet.utils.sequence_parallel_utils import AllGatherOp

                return AllGatherOp.apply(*args, **kwargs)
            return stock_gather.apply(*args, **kwargs)

    GatherOp.stock = stock_gather
    return GatherOp


def _make_attention_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        token = _IN_ATTENTION.set(bool(getattr(self, "sequence_parallel", False)))
        try:
            return original(self, *args, **kwargs)
        finally:
            _IN_ATTENTION.reset(token)

    return forward


def _make_moe_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        if tp > 1 and getattr(config, "sequence_parallel", False):  # whole on every rank, fed its own tokens
            mark_trained(list(self.experts.parameters()) + list(self.gate.parameters()))

    return __init__


def apply_to_deepseek_v3(patcher, modeling) -> None:
    """``DeepseekV3Attention``'s ``k_pe`` gathered with ``AllGatherOp`` under sequence parallelism;
    ``DeepseekV3MoE``'s routed experts and router marked sequence-parallel."""
    cls = patcher.require(modeling, "DeepseekV3Attention", DEEPSEEK_V3_MODULE)
    original = patcher.require(cls, "forward", f"{DEEPSEEK_V3_MODULE}.DeepseekV3Attention")
    stock_gather = patcher.require(modeling, "GatherOp", DEEPSEEK_V3_MODULE)
    patcher.set(modeling, "GatherOp", _make_gather(stock_gather))
    patcher.set(cls, "forward", _make_attention_forward(original))
    moe = patcher.require(modeling, "DeepseekV3MoE", DEEPSEEK_V3_MODULE)
    moe_init = patcher.require(moe, "__init__", f"{DEEPSEEK_V3_MODULE}.DeepseekV3MoE")
    patcher.check_params(moe_init, ["self", "config"], f"{DEEPSEEK_V3_MODULE}.DeepseekV3MoE.__init__")
    patcher.set(moe, "__init__", _make_moe_init(moe_init))


def _make_flex_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        if getattr(self, "ep_size", 1) > 1 and tp > 1 and getattr(config, "sequence_parallel", False):
            mark_trained(self.gate.parameters())

    return __init__


def apply_to_flex_layer(patcher, moe_layer) -> None:
    """``MoEFlexTokenLayer`` under EP > 1, TP > 1 and sequence parallelism: its gate's weights marked."""
    cls = patcher.require(moe_layer, "MoEFlexTokenLayer", FLEX_LAYER_MODULE)
    original = patcher.require(cls, "__init__", f"{FLEX_LAYER_MODULE}.MoEFlexTokenLayer")
    patcher.set(cls, "__init__", _make_flex_init(original))
