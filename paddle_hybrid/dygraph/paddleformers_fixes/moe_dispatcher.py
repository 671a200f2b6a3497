"""PaddleFormers 1.2's MoE layers under expert parallelism (an EP group of 2 or more): the all-to-all
path when it is asked for, and the layers that cannot run refused by name before the first step.

**The all-to-all path.**  ``ModularMoELayer`` (``nn/moe_deepep/modular_moe_layer.py``; Qwen3-MoE,
Qwen3-Next, and GLM4-MoE / GLM4V-MoE with ``use_unified_moe``, under EP > 1) reads
``moe_token_dispatcher_type`` from the model's configuration ("deepep", the default, or "alltoall")
and picks its communication by it (``DeepEPMoECommunication`` or ``AllToAllMoECommunication``); but
under EP > 1 it builds DeepEP's ``MoEFlexTokenDispatcher`` whatever was asked for.  That dispatcher's
``_DeepepManager`` raises ``ImportError("DeepEP is not supported in your paddlepaddle whl package.")``
when DeepEP's fused kernels are absent (every CPU build, any build without paddlefleet_ops' DeepEP),
so the all-to-all path, which never uses it (the layer hands it to ``AllToAllMoECommunication``,
which ignores it), could not be built.  Fixed on every device: with "alltoall" the layer gets no
DeepEP dispatcher (``token_dispatcher = None``); with "deepep" it is built as before.  The
all-to-all path is three ``alltoall_single`` calls of ``transformers/moe_layer.py``'s ``_AllToAll``,
which on a gloo group run on the plugin's all-to-all (``expert_parallel``).

**The DeepEP path where DeepEP is absent.**  The Flex token dispatcher (``MoEFlexTokenLayer``:
DeepSeek-V3's ``DeepseekV3MoEFlexToken``, GLM4-MoE's ``Glm4MoeFlexMoE``; and ``ModularMoELayer`` with
"deepep") moves tokens with DeepEP's ``fused_dispatch`` / ``fused_combine``; where DeepEP is absent
:mod:`.deepep_standin` supplies the plugin's gloo version of both
(:mod:`paddle_hybrid.common.deepep_gloo`), which serves a gloo group.  So these
layers build and train on a gloo expert-parallel group; :func:`flex_dispatch_serves` says whether a
group is served (DeepEP, or the gloo version on a gloo group).

**Refused by name** (:class:`ExpertParallelRefused`, at model construction, which the Trainer
scripts do before ``Trainer.train``), each only under EP > 1:

* ``ModularMoELayer`` with "deepep" where neither DeepEP nor the gloo version serves the
  expert-parallel group (no DeepEP, a group that is not gloo): names ``moe_token_dispatcher_type
  "alltoall"`` (where stock stops on the ImportError above, without a word of what would run).
* ``ModularMoELayer`` with tensor parallelism and without sequence parallelism (every device): its
  gate asserts ``sequence_parallel`` in the first forward (``moe_gate.py`` ``_cal_seq_aux_loss``, an
  ``AssertionError`` without a message); names ``--sequence_parallel true``.
* ``MoEFlexTokenLayer`` (GLM4-MoE without ``use_unified_moe``; DeepSeek-V3) where neither DeepEP nor
  the gloo version serves its group.  GLM4-MoE: names ``use_unified_moe`` true with "alltoall";
  DeepSeek-V3 has no other path.
* ``MoEFlexTokenLayer`` with tensor parallelism and without sequence parallelism (every device): every
  tensor-parallel rank holds the same tokens and would dispatch each; GLM4-MoE's gate asserts
  ``sequence_parallel`` at the first forward, DeepSeek-V3's attention stops on a reshape before;
  names ``--sequence_parallel true``.
* Qwen2-MoE's own model (``Qwen2MoeSparseMoeBlock``, in ``Qwen2MoeForCausalLMDeprecated`` and its
  pipe): it has no expert parallelism; every rank would hold every expert and the experts would train
  as data-parallel weights.  Refused on every device (paddlefleet's Qwen2-MoE is another class).
"""
from __future__ import annotations

import contextvars
import functools
import sys

from .families import FamilyRefused

__all__ = ["MODULAR_MODULE", "FLEX_LAYER_MODULE", "QWEN2_MOE_MODULE", "ExpertParallelRefused", "ep_degree",
           "deep_ep_available", "flex_dispatch_serves", "apply_to_modular", "apply_to_flex_layer", "apply_to_qwen2_moe"]

MODULAR_MODULE = "paddleformers.nn.moe_deepep.modular_moe_layer"
FLEX_LAYER_MODULE = "paddleformers.transformers.moe_layer"
QWEN2_MOE_MODULE = "paddleformers.transformers.qwen2_moe.modeling"
TOKEN_DISPATCHER_MODULE = "paddleformers.transformers.token_dispatcher"
WHERE = "(paddle_hybrid.paddleformers_fixes.moe_dispatcher)"
# PaddleFormers 1.2's ModularMoELayer.__init__ and MoEFlexTokenLayer.__init__: what the wrappers hand on.
MODULAR_PARAMS = ["self", "hidden_size", "moe_intermediate_size", "num_experts", "num_shared_experts",
                  "num_experts_per_tok", "norm_topk_prob", "expert_activation", "moe_config", "model_type",
                  "expert_class", "transpose_gate_weight", "pretrained_config"]
FLEX_PARAMS = ["self", "config", "moe_num_experts", "expert_class", "expert_kwargs", "gate", "moe_group"]
# MoEFlexTokenLayer subclasses: (family, what runs instead under expert parallelism)
FLEX_FAMILIES = {
    "Glm4MoeFlexMoE": ("GLM4-MoE", "set use_unified_moe true and moe_token_dispatcher_type \"alltoall\" in the model's "
                                   "configuration (PaddleFormers' ModularMoELayer on the all-to-all path)"),
    "DeepseekV3MoEFlexToken": ("DeepSeek-V3", "PaddleFormers 1.2 has no other expert-parallel path for it: train it "
                                              "without expert parallelism"),
}

FAMILY_NAMES = {"qwen3_moe": "Qwen3-MoE", "qwen3_next": "Qwen3-Next", "glm4_moe": "GLM4-MoE", "glm4v_moe": "GLM4V-MoE"}

_NO_DISPATCHER = contextvars.ContextVar("paddle_hybrid_moe_no_dispatcher", default=False)


class ExpertParallelRefused(FamilyRefused):
    """A PaddleFormers MoE layer that cannot run, or would train wrong, under expert parallelism here."""


def ep_degree() -> int:
    """The size of fleet's expert-parallel group, as PaddleFormers' layers read it (1 without one)."""
    try:
        from paddle.distributed import fleet
        import paddle.distributed as dist

        group = fleet.get_hybrid_communicate_group().get_expert_parallel_group()
    except Exception:  # noqa: BLE001  (what PaddleFormers' layers do: no hybrid group, or none for experts)
        return 1
    return dist.get_world_size(group) if group is not None else 1


def deep_ep_available() -> bool:
    """Whether PaddleFormers' token dispatcher has DeepEP's fused kernels (``fused_dispatch``; the
    plugin's gloo version, :mod:`.deepep_standin`, is not DeepEP)."""
    from .deepep_standin import gloo_installed

    dispatcher = sys.modules.get(TOKEN_DISPATCHER_MODULE)
    return (dispatcher is not None and getattr(dispatcher, "fused_dispatch", None) is not None
            and not gloo_installed())


def flex_dispatch_serves(group) -> bool:
    """Whether PaddleFormers' Flex token dispatcher can move tokens over ``group``: DeepEP, or the
    plugin's gloo version of it (:mod:`.deepep_standin`) on a gloo group."""
    from ...common.deepep_gloo import serves
    from .deepep_standin import gloo_installed

    return deep_ep_available() or (gloo_installed() and serves(group))


def _expert_group():
    try:
        from paddle.distributed import fleet

        return fleet.get_hybrid_communicate_group().get_expert_parallel_group()
    except Exception:  # noqa: BLE001  (as ep_degree: no hybrid group)
        return None


def _dispatcher_type(pretrained_config) -> str:
    return pretrained_config.get("moe_token_dispatcher_type", "deepep") if pretrained_config is not None else "deepep"


def _make_modular_init(original):
    @functools.wraps(original)
    def __init__(self, hidden_size, moe_intermediate_size, num_experts, num_shared_experts, num_experts_per_tok,
                 norm_topk_prob, expert_activation, moe_config, model_type, expert_class, transpose_gate_weight,
                 pretrained_config=None):
        kind = _dispatcher_type(pretrained_config)
        if kind == "deepep" and ep_degree() > 1 and not flex_dispatch_serves(_expert_group()):
            raise ExpertParallelRefused(
                f"{FAMILY_NAMES.get(model_type, model_type)}: expert parallelism ({ep_degree()}) with "
                "moe_token_dispatcher_type \"deepep\" (the default) needs DeepEP's fused kernels "
                "(paddlefleet_ops.deep_ep, GPU only), which this build lacks, and the expert-parallel group is "
                "not a gloo group (the plugin's gloo version of DeepEP's dispatch serves gloo groups only). "
                "Set moe_token_dispatcher_type \"alltoall\" in the model's configuration (config.json, or "
                f"--moe_token_dispatcher_type alltoall of examples/paddleformers_trainer.py). {WHERE}")
        tp = int(pretrained_config.get("tensor_model_parallel_size", 1) or 1) if pretrained_config is not None else 1
        if ep_degree() > 1 and tp > 1 and not pretrained_config.get("sequence_parallel", False):
            raise ExpertParallelRefused(
                f"{FAMILY_NAMES.get(model_type, model_type)}: expert parallelism ({ep_degree()}) with tensor "
                f"parallelism ({tp}) needs sequence parallelism (--sequence_parallel true): PaddleFormers' "
                "ModularMoELayer dispatches each tensor-parallel rank's part of the sequence, and its gate asserts "
                f"sequence_parallel at the first forward (an AssertionError without a message). {WHERE}")
        token = _NO_DISPATCHER.set(kind == "alltoall")
        try:
            original(self, hidden_size, moe_intermediate_size, num_experts, num_shared_experts, num_experts_per_tok,
                     norm_topk_prob, expert_activation, moe_config, model_type, expert_class, transpose_gate_weight,
                     pretrained_config)
        finally:
            _NO_DISPATCHER.reset(token)

    return __init__


def _make_dispatcher(original_cls):
    """``MoEFlexTokenDispatcher`` as ``modular_moe_layer`` calls it: None while an all-to-all layer
    is being built."""

    @functools.wraps(original_cls.__init__)
    def MoEFlexTokenDispatcher(*args, **kwargs):  # noqa: N802  (stands where the class is called)
        if _NO_DISPATCHER.get():
            return None
        return original_cls(*args, **kwargs)

    MoEFlexTokenDispatcher.__name__ = MoEFlexTokenDispatcher.__qualname__ = "MoEFlexTokenDispatcher"
    return MoEFlexTokenDispatcher


def apply_to_modular(patcher, modular) -> None:
    """``ModularMoELayer``: no DeepEP dispatcher for "alltoall"; "deepep" without DeepEP refused."""
    cls = patcher.require(modular, "ModularMoELayer", MODULAR_MODULE)
    original = patcher.require(cls, "__init__", f"{MODULAR_MODULE}.ModularMoELayer")
    patcher.check_params(original, MODULAR_PARAMS, f"{MODULAR_MODULE}.ModularMoELayer.__init__")
    dispatcher = patcher.require(modular, "MoEFlexTokenDispatcher", MODULAR_MODULE)
    patcher.set(modular, "MoEFlexTokenDispatcher", _make_dispatcher(dispatcher))
    patcher.set(cls, "__init__", _make_modular_init(original))


def _make_flex_init(original):
    @functools.wraps(original)
    def __init__(self, config, moe_num_experts, expert_class, expert_kwargs, gate, moe_group):
        if moe_group is not None and not flex_dispatch_serves(moe_group):
            import paddle.distributed as dist

            if dist.get_world_size(moe_group) > 1:
                family, instead = FLEX_FAMILIES.get(type(self).__name__, (type(self).__name__, "train it without "
                                                                                              "expert parallelism"))
                raise ExpertParallelRefused(
                    f"{family} ({type(self).__name__}) with expert parallelism ({dist.get_world_size(moe_group)}) "
                    "dispatches tokens with DeepEP only (PaddleFormers' MoEFlexTokenLayer), this build has no "
                    "DeepEP (paddlefleet_ops.deep_ep, GPU only), and the expert-parallel group is not a gloo group "
                    f"(the plugin's gloo version of DeepEP's dispatch serves gloo groups only): {instead}. {WHERE}")
        tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        if moe_group is not None and tp > 1 and not getattr(config, "sequence_parallel", False):
            import paddle.distributed as dist

            if dist.get_world_size(moe_group) > 1:
                family = FLEX_FAMILIES.get(type(self).__name__, (type(self).__name__,))[0]
                raise ExpertParallelRefused(
                    f"{family} ({type(self).__name__}) with expert parallelism ({dist.get_world_size(moe_group)}) "
                    f"and tensor parallelism ({tp}) needs sequence parallelism (--sequence_parallel true): without "
                    "it every tensor-parallel rank holds the same tokens and dispatches each of them, so every "
                    "expert would count each token once per rank; its gate asserts sequence_parallel at the "
                    "first forward (GLM4-MoE: an AssertionError without a message; DeepSeek-V3's attention stops "
                    f"earlier on a reshape). {WHERE}")
        original(self, config, moe_num_experts, expert_class, expert_kwargs, gate, moe_group)

    return __init__


def apply_to_flex_layer(patcher, moe_layer) -> None:
    """``MoEFlexTokenLayer`` under EP > 1: refused where neither DeepEP nor the gloo version serves its
    group, and with tensor parallelism without sequence parallelism, naming the family."""
    cls = patcher.require(moe_layer, "MoEFlexTokenLayer", FLEX_LAYER_MODULE)
    original = patcher.require(cls, "__init__", f"{FLEX_LAYER_MODULE}.MoEFlexTokenLayer")
    patcher.check_params(original, FLEX_PARAMS, f"{FLEX_LAYER_MODULE}.MoEFlexTokenLayer.__init__")
    patcher.set(cls, "__init__", _make_flex_init(original))


def qwen2_moe_refusal() -> ExpertParallelRefused | None:
    degree = ep_degree()
    if degree <= 1:
        return None
    return ExpertParallelRefused(
        f"Qwen2-MoE with expert parallelism ({degree}): PaddleFormers' own Qwen2-MoE (Qwen2MoeForCausalLMDeprecated, "
        "Qwen2MoeSparseMoeBlock) has no expert parallelism: every rank would hold every expert and train it as a "
        "data-parallel weight. Train it without expert parallelism (--use_expert_parallel / "
        "--expert_model_parallel_size), or use Qwen3-MoE, whose own model has an all-to-all expert-parallel path. "
        f"{WHERE}")


def _make_qwen2_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        refused = qwen2_moe_refusal()
        if refused is not None:
            raise refused
        original(self, config, *args, **kwargs)

    return __init__


def apply_to_qwen2_moe(patcher, modeling) -> None:
    """``Qwen2MoeSparseMoeBlock`` under EP > 1: refused (every device)."""
    cls = patcher.require(modeling, "Qwen2MoeSparseMoeBlock", QWEN2_MOE_MODULE)
    original = patcher.require(cls, "__init__", f"{QWEN2_MOE_MODULE}.Qwen2MoeSparseMoeBlock")
    patcher.check_params(original, ["self", "config"], f"{QWEN2_MOE_MODULE}.Qwen2MoeSparseMoeBlock.__init__")
    patcher.set(cls, "__init__", _make_qwen2_init(original))
