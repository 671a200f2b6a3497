"""PaddleFormers 1.2's DeepEP dispatch and combine, where DeepEP is absent, on gloo.

PaddleFormers' Flex token dispatcher (``transformers/token_dispatcher.py``: ``MoEFlexTokenDispatcher``
and its ``_DeepepManager``) moves tokens to their experts' ranks only through DeepEP
(``transformers/fused_a2a.py``'s ``fused_dispatch`` / ``fused_combine`` over ``deep_ep.Buffer``, NVLink
and RDMA kernels of paddlefleet_ops).  Without DeepEP, every CPU build and any build without
paddlefleet_ops' DeepEP, both are None (``HAVE_DEEP_EP = False``) and ``_DeepepManager`` raises
``ImportError("DeepEP is not supported in your paddlepaddle whl package.")`` when it is built.  That
dispatcher is the expert-parallel path of DeepSeek-V3 (``DeepseekV3MoEFlexToken``), of GLM4-MoE
without ``use_unified_moe`` (``Glm4MoeFlexMoE``), both ``MoEFlexTokenLayer``, and of the modular MoE
layer with ``moe_token_dispatcher_type "deepep"`` (its default; Qwen3-MoE, GLM4-MoE with
``use_unified_moe``).

Where DeepEP is absent, PaddleFormers 1.2.x, the two names in ``token_dispatcher`` (where the
dispatcher reads them) and in ``fused_a2a`` become the plugin's gloo implementation of the same
contract (:mod:`paddle_hybrid.common.deepep_gloo`: each token sent once to each rank
owning one of its experts, with its local expert ids and weights; the combine sums a token's expert
outputs back on its rank; each one's backward the other's forward).  It serves a gloo group with CPU
tensors; any other group or tensor gets :class:`~paddle_hybrid.common.deepep_gloo.DeepEPAbsentError`
(an ``ImportError`` with DeepEP's message), and :mod:`.moe_dispatcher` refuses such a layer when it
is built.  Where DeepEP is present nothing changes.  ``paddle_hybrid.uninstall()`` puts the Nones
back.  ``DispatchNode`` / ``CombineNode`` and the ``fused_*_func`` helpers of ``fused_a2a`` (used only
by PaddleFormers' DeepSeek-V3 pre-training scripts under ``cli/``) still need DeepEP.
"""
from __future__ import annotations

import sys

__all__ = ["TOKEN_DISPATCHER_MODULE", "FUSED_A2A_MODULE", "apply_to_token_dispatcher", "gloo_installed",
           "deep_ep_present", "fused_dispatch", "fused_combine"]

TOKEN_DISPATCHER_MODULE = "paddleformers.transformers.token_dispatcher"
FUSED_A2A_MODULE = "paddleformers.transformers.fused_a2a"
MARK = "__paddle_hybrid_deepep_gloo__"


def fused_dispatch(x, token_indices, token_probs, num_experts, group, previous_event=None):
    """``fused_a2a.fused_dispatch`` on gloo: ``(recv_x, recv_token_probs, states)``."""
    from ...common import deepep_gloo

    return deepep_gloo.dispatch(x, token_indices, token_probs, num_experts, group, previous_event)


def fused_combine(x, group, handle, previous_event=None):
    """``fused_a2a.fused_combine`` on gloo: the combined ``[tokens, hidden]``."""
    from ...common import deepep_gloo

    return deepep_gloo.combine(x, group, handle, previous_event)


for _fn in (fused_dispatch, fused_combine):
    setattr(_fn, MARK, True)


def gloo_installed() -> bool:
    """Whether PaddleFormers' token dispatcher is on the gloo implementation (DeepEP absent)."""
    module = sys.modules.get(TOKEN_DISPATCHER_MODULE)
    return module is not None and getattr(getattr(module, "fused_dispatch", None), MARK, False)


def deep_ep_present() -> bool:
    """Whether PaddleFormers' ``fused_a2a`` found DeepEP's kernels (``HAVE_DEEP_EP``)."""
    module = sys.modules.get(FUSED_A2A_MODULE)
    return bool(getattr(module, "HAVE_DEEP_EP", False))


def apply_to_token_dispatcher(patcher, token_dispatcher) -> None:
    """``fused_dispatch`` / ``fused_combine`` of ``token_dispatcher`` and ``fused_a2a``: the gloo
    implementation, only where ``fused_a2a`` has no DeepEP (both None)."""
    fused_a2a = sys.modules.get(FUSED_A2A_MODULE)
    patcher.require(token_dispatcher, "_DeepepManager", TOKEN_DISPATCHER_MODULE)
    if fused_a2a is None or getattr(fused_a2a, "HAVE_DEEP_EP", None) is not False:
        return  # DeepEP present (or a fused_a2a unlike 1.2's): PaddleFormers' own
    for module, name in ((token_dispatcher, TOKEN_DISPATCHER_MODULE), (fused_a2a, FUSED_A2A_MODULE)):
        for attr, gloo in (("fused_dispatch", fused_dispatch), ("fused_combine", fused_combine)):
            if getattr(module, attr, 0) is None:
                patcher.set(module, attr, gloo)
