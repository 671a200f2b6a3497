"""Balanced routing of PaddleFormers 1.2's own MoE gates.

PaddleFormers chooses experts in three kinds of places; each is replaced where the choice is made,
so the gate's projection, its scoring function, its normalization of the chosen scores, its
capacity handling and its auxiliary losses all run as written, over the balanced choice:

=====================================  =============================================================
where the choice is made               replaced by
=====================================  =============================================================
the top-k choosers of the gate base    ``_topk_greedy``, ``_topk_group_limited_greedy``,
classes: ``PretrainedMoEGate``         ``_topk_noaux_tc``: the experts round-robin, the scores at
(``transformers/moe_gate.py``) and     them (for ``noaux_tc`` the scores without the correction
the modular layer's ``MoEGateMixin``   bias, which only ever steers the choice).  Covers every gate
(``nn/moe_deepep/moe_gate.py``)        built on them (``topkgating``, ``topkgating_nodrop``):
                                       DeepSeek-V3 and GLM4-MoE under expert parallelism (their flex
                                       routers), and the modular MoE layer (Qwen3-MoE under expert
                                       parallelism, GLM4-MoE ``use_unified_moe``)
``get_topk_indices`` of                the experts round-robin; the router's forward takes its
``DeepseekV3TopkRouter`` and           scores at them and normalizes and scales them as it does
``Glm4MoeTopkRouter``                  (DeepSeek-V3 and GLM4-MoE without expert parallelism)
``paddle.topk`` inside the forward of  a ``topk`` that answers with the experts round-robin and the
``Qwen2MoeSparseMoeBlock``,            scores at them, seen by that module only and only while one
``Qwen3MoeSparseMoeBlock`` and         of those forwards runs (the module's ``paddle`` becomes a view
``GptOssTopKRouter``                   of the real one); the block goes on as written (Qwen's
                                       softmax scores renormalized with ``norm_topk_prob``, GPT-OSS's
                                       softmax over the chosen logits).  The module's
                                       ``load_balancing_loss_func`` (the models' auxiliary loss
                                       when ``output_router_logits``) sees the same ``topk``, each
                                       layer's rows round-robin as that layer routed them
=====================================  =============================================================

Each routing call is recorded (:mod:`paddle_hybrid.common.routing_record`) with the tokens the
choice sent each expert; a gate with a capacity factor (``drop_tokens``, off in every model of
PaddleFormers 1.2) then drops tokens as it does, after the count.

The Qwen2-MoE, Qwen3-MoE and GLM4-MoE blocks and routers above are PaddleFormers' own models of
those families (``...ForCausalLMDeprecated``, the pipeline's ``...PipeDeprecated``); their
``...ForCausalLM`` in 1.2 is paddlefleet's ``GPTModel``, whose routing is paddlefleet's and not
covered.  On a CPU machine, of these modules only GPT-OSS's imports (the others import the GPU-only
paddlefleet / paddlefleet_ops); the rest are covered for when they import.

Not covered: ERNIE-4.5-MoE (``nn/moe/topk_gate.TopKGate`` and its all-gather layer choose and
dispatch in fused GPU kernels, ``expand_modality_expert_id`` and
``moe_gate_dispatch_partial_nosoftmaxtopk``, which have no CPU kernel: the model does not step on
CPU), the auto-parallel gate (``transformers/moe_gate_auto.py``), the old ``top1gating`` /
``top2gating`` of ``PretrainedMoEGate`` (no model of 1.2 calls them), and the other MoE families
(Qwen3-VL-MoE, Qwen3-Next's own layers, ...).

PaddleFormers is imported by the user's script, if ever: each change waits for its module
(:func:`paddle_hybrid.common.import_hook.when_imported`).  Written for PaddleFormers
``VERIFIED_PADDLEFORMERS``; with another version nothing of PaddleFormers is changed and a warning
says so.
"""
from __future__ import annotations

import importlib.metadata
import threading
import warnings

import numpy as np

from ...common import routing_record
from ...registry.patching import DeviceAnswers, describe_versions, version_supported
from .round_robin import balanced_indices

__all__ = ["VERIFIED_PADDLEFORMERS", "CHOOSERS", "ROUTERS", "INLINE", "apply", "paddleformers_version"]

VERIFIED_PADDLEFORMERS = ("1.2.",)

_CHOOSER_PARAMS = {
    "_topk_greedy": ["self", "scores", "k"],
    "_topk_group_limited_greedy": ["self", "scores", "k", "n_group", "topk_group"],
    "_topk_noaux_tc": ["self", "scores", "k", "n_group", "topk_group"],
}
# module -> the class whose top-k choosers every gate of the module inherits
CHOOSERS = {
    "paddleformers.transformers.moe_gate": "PretrainedMoEGate",
    "paddleformers.nn.moe_deepep.moe_gate": "MoEGateMixin",
}
# module -> router class whose get_topk_indices(self, scores) chooses
ROUTERS = {
    "paddleformers.transformers.deepseek_v3.modeling": "DeepseekV3TopkRouter",
    "paddleformers.transformers.glm4_moe.modeling": "Glm4MoeTopkRouter",
}
# module -> the class whose forward(self, hidden_states) calls paddle.topk to choose
INLINE = {
    "paddleformers.transformers.qwen2_moe.modeling": "Qwen2MoeSparseMoeBlock",
    "paddleformers.transformers.qwen3_moe.modeling": "Qwen3MoeSparseMoeBlock",
    "paddleformers.transformers.gpt_oss.modeling": "GptOssTopKRouter",
}
LOSS_FUNCTION = "load_balancing_loss_func"
LOSS_PARAMS = ["gate_logits", "num_experts", "top_k", "attention_mask"]


def paddleformers_version() -> str | None:
    """The installed PaddleFormers' version (read without importing it), None when it is absent."""
    try:
        return importlib.metadata.version("paddleformers")
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- the choice


def _choose(scores, top_k: int, rows_per_layer: int | None = None, record: bool = True):
    """``(weights, indices)`` for the 2-D ``scores`` ``[rows, experts]``: the balanced experts of each
    row (int64 ``[rows, top_k]``, on the scores' place) and the scores at them (the scores' dtype,
    differentiable).  ``rows_per_layer``: the rows are layers' batches one after another, each
    routed on its own."""
    import paddle

    rows, experts = int(scores.shape[0]), int(scores.shape[-1])
    if rows_per_layer and rows % rows_per_layer == 0:
        chosen = np.tile(balanced_indices(rows_per_layer, top_k, experts), (rows // rows_per_layer, 1))
    else:
        chosen = balanced_indices(rows, top_k, experts)
    indices = paddle.to_tensor(chosen, place=scores.place)
    if record:
        routing_record.note("forced-balanced", np.bincount(chosen.reshape(-1), minlength=experts).tolist(), top_k)
    return paddle.take_along_axis(scores, indices, axis=-1), indices


def topk_greedy(self, scores, k):
    return _choose(scores, int(k))


def topk_group_limited_greedy(self, scores, k, n_group, topk_group):
    return _choose(scores, int(k))


def topk_noaux_tc(self, scores, k, n_group, topk_group):
    return _choose(scores, int(k))


CHOOSER_FORWARDS = {"_topk_greedy": topk_greedy, "_topk_group_limited_greedy": topk_group_limited_greedy,
                    "_topk_noaux_tc": topk_noaux_tc}


def get_topk_indices(self, scores):
    """The router's experts, round-robin (its caller gathers its scores at them); no gradient, as
    the router's own."""
    import paddle

    with paddle.no_grad():
        return _choose(scores.reshape([-1, int(self.n_routed_experts)]), int(self.top_k))[1]


# --------------------------------------------------------------------------- topk inside a forward

_STATE = threading.local()  # depth: inside a covered forward; rows_per_layer: inside a loss function


def _inside() -> bool:
    return getattr(_STATE, "depth", 0) > 0


def balanced_topk(x, k, axis=-1, largest=True, sorted=True, name=None, **aliases):
    """``paddle.topk`` as a covered module sees it inside a covered forward: ``(values, indices)``
    with the experts round-robin over the last axis of a 2-D ``x``.  Any other call (another axis,
    another rank, ``largest=False``) is Paddle's."""
    import paddle

    axis = aliases.pop("dim", axis)
    if aliases or x.ndim != 2 or axis not in (-1, 1) or not largest:
        return paddle.topk(x, k, axis=axis, largest=largest, sorted=sorted, name=name, **aliases)
    rows_per_layer = getattr(_STATE, "rows_per_layer", None)
    return _choose(x, int(k), rows_per_layer, record=rows_per_layer is None)


class RoutingView(DeviceAnswers):
    """A PaddleFormers model module's ``paddle``: its ``topk`` is :func:`balanced_topk` while a
    covered forward runs, everything else is Paddle's."""

    def __repr__(self):
        return f"<paddle with a balanced topk inside {self._why}>"


def _entered(forward):
    """``forward`` with the covered state entered around it."""

    def balanced_forward(self, hidden_states):
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            return forward(self, hidden_states)
        finally:
            _STATE.depth -= 1

    return balanced_forward


def _per_layer(loss_function):
    """``load_balancing_loss_func`` with each layer's rows routed round-robin as the layer did."""

    def balanced_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if not isinstance(gate_logits, tuple) or not gate_logits or getattr(gate_logits[0], "ndim", 0) != 2:
            return loss_function(gate_logits, num_experts, top_k, attention_mask)
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        _STATE.rows_per_layer = int(gate_logits[0].shape[0])
        try:
            return loss_function(gate_logits, num_experts, top_k, attention_mask)
        finally:
            _STATE.depth -= 1
            _STATE.rows_per_layer = None

    return balanced_loss


# --------------------------------------------------------------------------- applying


def _patch_choosers(patcher, module, class_name: str) -> None:
    owner = patcher.require(module, class_name, module.__name__)
    for name, params in _CHOOSER_PARAMS.items():
        patcher.check_params(owner.__dict__.get(name), params, f"{class_name}.{name}")
    for name in _CHOOSER_PARAMS:
        patcher.set(owner, name, CHOOSER_FORWARDS[name])


def _patch_router(patcher, module, class_name: str) -> None:
    owner = patcher.require(module, class_name, module.__name__)
    patcher.check_params(owner.__dict__.get("get_topk_indices"), ["self", "scores"], f"{class_name}.get_topk_indices")
    patcher.set(owner, "get_topk_indices", get_topk_indices)


def _patch_inline(patcher, module, class_name: str) -> None:
    import types

    owner = patcher.require(module, class_name, module.__name__)
    forward = owner.__dict__.get("forward")
    patcher.check_params(forward, ["self", "hidden_states"], f"{class_name}.forward")
    loss = patcher.require(module, LOSS_FUNCTION, module.__name__)
    patcher.check_params(loss, LOSS_PARAMS, f"{module.__name__}.{LOSS_FUNCTION}")
    real = patcher.require(module, "paddle", module.__name__)
    if not isinstance(real, (types.ModuleType, DeviceAnswers)):
        raise _unexpected(patcher, f"{module.__name__}.paddle is {real!r}, not the paddle module")
    patcher.require(real, "topk", f"{module.__name__}.paddle")
    patcher.set(owner, "forward", _entered(forward))
    patcher.set(module, LOSS_FUNCTION, _per_layer(loss))
    patcher.set(module, "paddle", RoutingView(real, {"topk": balanced_topk}, _inside,
                                              f"{class_name}.forward and {LOSS_FUNCTION}"))


def _unexpected(patcher, what: str):
    from ...registry.patching import PatchSignatureError

    return PatchSignatureError(f"{patcher.component}: {what}; unexpected PaddleFormers. Set {patcher.off_switch} "
                               "to run without these patches.")


def apply(config, patcher) -> str:
    """Wait for each covered PaddleFormers module and patch it when it is imported (at once if it
    is); returns what ``report()`` says of PaddleFormers."""
    from ...common.import_hook import when_imported

    version = paddleformers_version()
    if version is None:
        return "PaddleFormers not installed: its gates not covered"
    if not version_supported(version, VERIFIED_PADDLEFORMERS):
        warnings.warn(f"paddle_hybrid.dygraph.balanced_routing: PaddleFormers' MoE gates are covered for PaddleFormers "
                      f"{describe_versions(VERIFIED_PADDLEFORMERS)}, this is {version}; they route as they do "
                      "(unbalanced in a dry run).", RuntimeWarning, stacklevel=2)
        written = describe_versions(VERIFIED_PADDLEFORMERS)
        return f"PaddleFormers {version}: its gates not covered (written for {written})"
    for table, patch in ((CHOOSERS, _patch_choosers), (ROUTERS, _patch_router), (INLINE, _patch_inline)):
        for module_name, class_name in table.items():
            cancel = when_imported(module_name, lambda module, p=patch, c=class_name: p(patcher, module, c))
            patcher.on_revert(cancel, f"the wait for {module_name}")
    return (f"PaddleFormers' gates when imported (PaddleFormers {describe_versions(VERIFIED_PADDLEFORMERS)}: "
            "DeepSeek-V3, GLM4-MoE, Qwen2-MoE, Qwen3-MoE, GPT-OSS)")
