"""PaddleFormers 1.2's all-to-all expert parallelism: with more than one sequence per micro-batch,
tokens are computed by another expert than the one the gate chose.

Where: ``AllToAllMoECommunication.forward`` (``nn/moe_deepep/moe_communication.py``), the
``moe_token_dispatcher_type="alltoall"`` path of ``ModularMoELayer``
(``nn/moe_deepep/modular_moe_layer.py``), taken only with expert parallelism (an EP group of more
than one rank; at EP 1 the layer runs its experts in a loop of its own).  The families that build
``ModularMoELayer`` under EP > 1 through ``QuickAccessMoEFactory``: Qwen3-MoE and Qwen3-Next,
GLM4-MoE and GLM4V-MoE (with ``use_unified_moe``).

The defect: ``forward`` takes ``seq_len`` from its input's shape, ``[batch, seq_len, hidden]``,
while ``mask`` (the gate's ``[tokens, experts]`` routing, ``tokens = batch * seq_len``) numbers the
tokens over the whole micro-batch.  It orders the (token, expert) pairs for the exchange by
``argsort(expert * seq_len + token)`` and then cuts that order into runs of ``tokens_per_expert``,
run ``e`` going to expert ``e``.  With ``batch`` > 1 the key is no longer expert-major: token
``seq_len + t`` (position ``t`` of the second sequence) routed to expert ``e`` gets the key of token
``t`` routed to expert ``e + 1``, so the pairs of expert ``e`` from the second sequence are sorted in
among those of expert ``e + 1`` from the first, and the runs hand some tokens to the neighbouring
expert (or to the neighbouring rank's, when ``e`` is the last expert of a rank).  The combine still
weights each output with the gate value of the expert that was chosen and adds it to the right
token: the output has the right shape and plausible values, and is wrong.  ``batch`` = 1 and a
flattened ``[tokens, hidden]`` input (``seq_len`` = tokens) are right; ``ModularMoELayer.forward``
passes its input unflattened (``[batch, seq_len, hidden]``), except under sequence parallelism.

The fix: a micro-batch of more than one sequence is handed to PaddleFormers' ``forward``
flattened, ``[batch * seq_len, hidden]``, so ``seq_len`` is the number of tokens the mask numbers
and the key ``expert * tokens + token`` is expert-major and unique.  ``forward`` returns
``[tokens, hidden]`` for either input shape (the caller reshapes it back), so nothing else changes;
a single sequence, a flat input and EP 1 reach PaddleFormers unchanged.

Checked (``tests/dygraph/paddleformers_fixes/test_moe_alltoall_order.py``, EP 2 on gloo, 4 experts,
top-2): two sequences as one micro-batch of 2 against the same sequences as two micro-batches of 1,
outputs and gradients, and both against the dense mixture (every expert on every token, weighted
by the gate); stock PaddleFormers' micro-batch of 2 differs, the fixed one equals.
"""
from __future__ import annotations

import functools

__all__ = ["MODULE", "CLASS", "PARAMS", "apply_to", "flattened_forward"]

MODULE = "paddleformers.nn.moe_deepep.moe_communication"
CLASS = "AllToAllMoECommunication"
# PaddleFormers 1.2's AllToAllMoECommunication.forward: what the replacement accepts and hands on.
PARAMS = ["self", "hidden_states", "topk_indices", "topk_weights", "gates_masked", "mask", "priorities",
          "expert_model_parallel_size", "moe_group", "experts", "moe_rank", "num_experts_per_device", "num_experts",
          "topk", "token_dispatcher"]


def flattened_forward(original):
    """``original`` (PaddleFormers' ``forward``) called with a multi-sequence input flattened to
    ``[tokens, hidden]``, the token numbering of the gate's ``mask``."""

    @functools.wraps(original)
    def forward(self, hidden_states, topk_indices, topk_weights, gates_masked, mask, priorities,
                expert_model_parallel_size, moe_group, experts, moe_rank, num_experts_per_device, num_experts, topk,
                token_dispatcher):
        if expert_model_parallel_size > 1 and len(hidden_states.shape) == 3 and hidden_states.shape[0] > 1:
            hidden_states = hidden_states.reshape([-1, hidden_states.shape[-1]])
        return original(self, hidden_states, topk_indices, topk_weights, gates_masked, mask, priorities,
                        expert_model_parallel_size, moe_group, experts, moe_rank, num_experts_per_device, num_experts,
                        topk, token_dispatcher)

    return forward


def apply_to(patcher, moe_communication) -> None:
    """Replace ``AllToAllMoECommunication.forward`` in PaddleFormers' ``moe_communication`` module
    (``MODULE``)."""
    cls = patcher.require(moe_communication, CLASS, MODULE)
    original = patcher.require(cls, "forward", f"{MODULE}.{CLASS}")
    patcher.check_params(original, PARAMS, f"{MODULE}.{CLASS}.forward")
    patcher.set(cls, "forward", flattened_forward(original))
