"""Fixes of PaddleFormers defects that stop its ``Trainer`` on every device.

=======================  ==============================================================
fix                      what it mends (details in the module's docstring)
=======================  ==============================================================
:mod:`.grad_norm_hook`   TP / PP / sharding with ``max_grad_norm > 0`` (the default):
                         ``'AdamW' object has no attribute '_inner_opt'``
:mod:`.flex_checkpoint_load`  the Trainer's flex-checkpoint resume: a parameter with no
                         optimizer state restarts its moments silently (now an error);
                         one process: ``'Fleet' object has no attribute '_hcg'``
:mod:`.trainer_resume`   ``resume_from_checkpoint=True`` / ``"True"`` fails; a checkpoint
                         cut by a death is loaded; a restarted job starts at step 1.  Now:
                         the newest complete checkpoint, by itself after a restart
:mod:`.cpu_precision`    ``--bf16`` on CPU trains float32 silently, ``--fp16`` stops at
                         step 1: now both stop at the start naming the flag
:mod:`.recompute_flags`  ``--recompute_granularity/method/num_layers`` never reach
                         the model's config: no layer is recomputed (every device)
:mod:`.families`         GPT-OSS and Gemma3 under tensor parallelism train wrong
                         (refused)
:mod:`.paddlefleet_standins`  Qwen2/Qwen3(-MoE), GLM4-MoE, DeepSeek-V3 stop at import on
                         a machine without paddlefleet / paddlefleet_ops (GPU-only):
                         stand-ins, and the Auto classes give PaddleFormers' own
                         ``...Deprecated`` models (only while those are absent)
:mod:`.moe_dispatcher`   expert parallelism with ``moe_token_dispatcher_type="alltoall"``
                         built DeepEP's dispatcher anyway (fails without DeepEP; now
                         none is built); layers that cannot run under EP refused by
                         name (DeepEP-only layers without DeepEP, TP without SP,
                         Qwen2-MoE's own model)
:mod:`.deepep_standin`   where DeepEP is absent, PaddleFormers' Flex token dispatcher
                         (DeepSeek-V3 and GLM4-MoE's Flex layers, the modular layer's
                         "deepep") could not be built under EP: DeepEP's dispatch and
                         combine on gloo (``common.deepep_gloo``)
:mod:`.deepseek_v3_sequence_parallel`  TP + sequence parallel: DeepSeek-V3's rotary key
                         dropped the other ranks' heads' gradient; its MoE block's experts
                         and router and, under EP, the Flex layer's gate trained from each
                         rank's part (fixed; every device)
:mod:`.ernie_moe_layouts`  ERNIE-4.5-MoE with its experts over TP and no sequence parallel
                         routed each token once per TP rank (refused; every device)
:mod:`.moe_sequence_parallel`  TP + sequence parallel: Qwen3-MoE's final norm and, under
                         EP, the modular MoE layer's gate trained from each rank's
                         part of the gradient (now marked sequence-parallel; every
                         device)
:mod:`.auto_grad_accumulation`  ``--enable_auto_parallel 1`` with gradient accumulation
                         sums the micro-batches' gradients (fleet averages them)
:mod:`.auto_parallel_weights`  ``--enable_auto_parallel 1``: every weight empty after
                         training, no save works (Paddle's fused FSDP); now gathered
                         after ``train()`` and for each save, the fused optimizer
                         state saved and resumed per parameter
:mod:`.auto_parallel_layouts`  ``--enable_auto_parallel 1`` with tensor parallelism on CPU:
                         a one-rank FSDP group, then a segmentation fault (refused)
:mod:`.pipe_models`      the generic pipeline model: ERNIE-4.5's default segmentation
                         names a class it never builds (fixed); sliding-window
                         attention dropped, eager attention without a causal mask
                         (refused)
:mod:`.padding_embedding`  the padding token (``pad_token_id``, LLaMA's default 0) is
                         zeros and untrained in one process, trained under a pipeline
                         or tensor parallelism: other gradients (fixed)
:mod:`.sink_attention`   ``sdpa`` attention with sinks (GPT-OSS) is flash attention
                         only: on CPU it stopped on a CUDA-only flag; now computed
                         with CPU operators, as the eager implementation does
:mod:`.segment_parallel`  ``--sep_parallel_size`` > 1: PaddleFormers' models run each
                         sep rank's part of the sequence alone (no attention over the
                         sep group); trains other gradients on every device (refused)
:mod:`.moe_alltoall_order`  expert parallelism with ``moe_token_dispatcher_type="alltoall"``
                         and a micro-batch of more than one sequence: tokens computed by
                         a neighbouring expert (fixed: the micro-batch sorted as one
                         sequence of tokens); every device
:mod:`.moe_cpu_ops`      ERNIE-4.5-MoE's MoE layer: ``get_async_loader`` reads a global
                         never defined (``NameError`` without ``fleet.init``, every
                         device); on a CPU build ``create_async_load`` needs
                         ``core.AsyncLoad``, which only accelerator builds have (now a
                         host copy); its MoE ops are CPU kernels of
                         ``paddle_hybrid.dygraph.expert_parallel.moe_kernels``
:mod:`.ernie_moe_checkpoint`  ERNIE-4.5-MoE without ``moe_use_aux_free`` does not load back
                         (``from_pretrained``: the key is never saved, and the conversion
                         rules name the bias), without shared experts cannot be saved (fixed)
:mod:`.fake_world_files`  a dry run only (the fake world): the Trainer's resume looked for
                         a checkpoint's scheduler and state through an exchange of the
                         ranks' answers; now each rank looks at the disk itself
=======================  ==============================================================

PaddleFormers is optional and heavy, so nothing is imported at ``import paddle_hybrid``: the
fixes wait for ``paddleformers.trainer.trainer`` (:mod:`paddle_hybrid.common.import_hook`) and are made, through this
component's Patcher, when it is first imported; :func:`paddle_hybrid.patches` lists them from then
on.  They were written for PaddleFormers ``VERIFIED_PADDLEFORMERS``; with another version the
fixes are not made and a warning names the version and the switch.

Why fixes and not flags: the first defect is an ``AttributeError`` raised before the first step,
on GPU as on CPU, and its fix makes PaddleFormers' own line do what it says (record the global
norm in the training logs); no number a training run computes changes.  The second turns a
silently wrong resume into an error; a run that resumed correctly is unaffected.  The third adds
two barriers and two marker files to each save, and resumes by itself only in a restart the
launcher made.

When: ``PluginConfig.paddleformers_fixes`` (``PADDLE_HYBRID_PADDLEFORMERS_FIXES``, default on),
on any device.
"""
from __future__ import annotations

import importlib.metadata
import warnings

from ...registry.component import Component
from ...registry.patching import Patcher, describe_versions, version_supported

__all__ = ["COMPONENT", "apply", "VERIFIED_PADDLEFORMERS", "TRAINER_MODULE"]

VERIFIED_PADDLEFORMERS = ("1.2.",)
TRAINER_MODULE = "paddleformers.trainer.trainer"
PIPE_MODULE = "paddleformers.nn.pp_model"
SDPA_MODULE = "paddleformers.nn.attention.sdpa_attention"
EMBEDDING_MODULE = "paddleformers.nn.embedding"
MOE_COMMUNICATION_MODULE = "paddleformers.nn.moe_deepep.moe_communication"
MOE_UTILS_MODULE = "paddleformers.nn.moe.utils"
ERNIE_MOE_MODULE = "paddleformers.transformers.ernie4_5_moe.modeling"
ERNIE_MOE_CONFIG_MODULE = "paddleformers.transformers.ernie4_5_moe.configuration"
# report()'s words for the fix a user's own MoE script may need without the trainer (issue 53)
MOE_NOTE = (f"; {MOE_COMMUNICATION_MODULE} likewise (the all-to-all MoE expert order, moe_alltoall_order); "
            f"{MOE_UTILS_MODULE} likewise (its undefined async_loader; on a build without AsyncLoad, the CPU "
            "build, a host copy for the asynchronous offload: moe_cpu_ops); "
            f"{ERNIE_MOE_CONFIG_MODULE} and {ERNIE_MOE_MODULE} likewise (ERNIE-4.5-MoE's saved configuration and "
            "checkpoint rules, ernie_moe_checkpoint); nn.moe_deepep.modular_moe_layer, transformers.moe_layer and "
            "qwen2_moe.modeling likewise (expert parallelism: the all-to-all path without DeepEP's dispatcher, the "
            "layers that cannot run refused: moe_dispatcher); qwen3_moe.modeling and the modular MoE layer likewise "
            "(sequence-parallel marks of Qwen3-MoE's final norm and, under EP, the gate: moe_sequence_parallel); "
            "deepseek_v3.modeling and transformers.moe_layer likewise (sequence parallelism: DeepSeek-V3's rotary key "
            "gathered with a reduce-scatter backward, its MoE block's experts and router and, under EP, the Flex "
            "layer's gate marked: deepseek_v3_sequence_parallel); ERNIE-4.5-MoE's experts over the TP group without "
            "sequence parallelism refused (ernie_moe_layouts); a flex checkpoint's fused gate/up projection resumed "
            "at another TP degree refused (fused_gate_up_resume)")


def _paddleformers_version() -> str:
    try:
        return importlib.metadata.version("paddleformers")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _fix_trainer(patcher: Patcher, trainer_module) -> None:
    """Phases: version check (warn and leave PaddleFormers alone if unverified), then the fixes."""
    if not _on_verified_version("paddle_hybrid.dygraph.paddleformers_fixes", "its fixes are not made"):
        return
    from . import (auto_grad_accumulation, auto_parallel_weights, fake_world_files, flex_checkpoint_load,
                   grad_norm_hook, trainer_resume, trainer_start)

    grad_norm_hook.fix(patcher, trainer_module)
    auto_grad_accumulation.fix(patcher, trainer_module)
    flex_checkpoint_load.fix(patcher, trainer_module)
    trainer_resume.fix(patcher, trainer_module)
    trainer_start.fix(patcher, trainer_module)  # cpu_precision, auto_parallel_layouts and recompute_flags
    auto_parallel_weights.fix(patcher, trainer_module)
    fake_world_files.fix(patcher, trainer_module)  # a dry run only: a checkpoint's small files read locally


def _fix_pipe_models(patcher: Patcher, pp_model) -> None:
    """The generic pipeline model's fixes (:mod:`.pipe_models`), on a verified PaddleFormers."""
    if version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        from . import padding_embedding, pipe_models

        pipe_models.apply_to(patcher, pp_model)
        padding_embedding.apply_to_pipe(patcher, pp_model)


def _fix_embedding(patcher: Patcher, embedding) -> None:
    """The padding token under tensor parallelism (:mod:`.padding_embedding`), on a verified PaddleFormers."""
    if version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        from . import padding_embedding

        padding_embedding.apply_to_embedding(patcher, embedding)


def _hook_families(patcher: Patcher) -> None:
    """The refusals of :mod:`.families`, each when its module is imported (a verified PaddleFormers);
    the stand-ins of :mod:`.paddlefleet_standins` (a finder that checks the version when it is asked),
    the expert-parallel layers of :mod:`.moe_dispatcher` and the marks of :mod:`.moe_sequence_parallel`."""
    import sys

    from ...common.import_hook import when_imported
    from . import paddlefleet_standins

    finder = paddlefleet_standins.StandInFinder(lambda: _on_verified_version(
        "paddle_hybrid.dygraph.paddleformers_fixes.paddlefleet_standins",
        "paddlefleet and paddlefleet_ops are not stood in for (their import errors stand)"))
    sys.meta_path.insert(0, finder)
    patcher.on_revert(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None,
                      "the stand-ins of paddlefleet / paddlefleet_ops (sys.meta_path)")
    if not version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        return
    from . import (deepep_standin, deepseek_v3_sequence_parallel, ernie_moe_layouts, families, moe_dispatcher,
                   moe_sequence_parallel)

    for name in families.REFUSE_TENSOR_PARALLEL:
        cancel = when_imported(name, lambda module: families.refuse_in(patcher, module))
        patcher.on_revert(cancel, f"the wait for {name}")
    for name, fix in ((paddlefleet_standins.AUTO_MODELING, paddlefleet_standins.apply_to_auto),
                      (moe_dispatcher.MODULAR_MODULE, moe_dispatcher.apply_to_modular),
                      (moe_dispatcher.FLEX_LAYER_MODULE, moe_dispatcher.apply_to_flex_layer),
                      (moe_dispatcher.QWEN2_MOE_MODULE, moe_dispatcher.apply_to_qwen2_moe),
                      (moe_sequence_parallel.QWEN3_MOE_MODULE, moe_sequence_parallel.apply_to_qwen3_moe),
                      (moe_dispatcher.MODULAR_MODULE, moe_sequence_parallel.apply_to_modular),
                      (deepep_standin.TOKEN_DISPATCHER_MODULE, deepep_standin.apply_to_token_dispatcher),
                      (deepseek_v3_sequence_parallel.DEEPSEEK_V3_MODULE,
                       deepseek_v3_sequence_parallel.apply_to_deepseek_v3),
                      (deepseek_v3_sequence_parallel.FLEX_LAYER_MODULE,
                       deepseek_v3_sequence_parallel.apply_to_flex_layer),
                      (ernie_moe_layouts.ERNIE_MOE_MODULE, ernie_moe_layouts.apply)):
        cancel = when_imported(name, lambda module, fix=fix: fix(patcher, module))
        patcher.on_revert(cancel, f"the wait for {name}")


def _standins_note() -> str:
    """report()'s words for the stand-ins: only where paddlefleet is absent."""
    from . import paddlefleet_standins

    missing = [p for p in ("paddlefleet", "paddlefleet_ops") if paddlefleet_standins.absent(p)]
    if not missing or not version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        return ""
    return (f"; {' and '.join(missing)} absent: stood in for at the import of "
            f"{' and '.join(m for m, p in paddlefleet_standins.NEEDS.items() if p in missing)}, "
            "AutoModelForCausalLM(Pipe) gives PaddleFormers' own ...Deprecated model of Qwen2/Qwen3(-MoE) and "
            "GLM4-MoE (paddlefleet_standins)")


def _deepep_note() -> str:
    """report()'s words for DeepEP's dispatch on gloo (:mod:`.deepep_standin`)."""
    from . import paddlefleet_standins

    if not version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        return ""
    where = ("DeepEP absent (no paddlefleet_ops)" if paddlefleet_standins.absent("paddlefleet_ops")
             else "where paddlefleet_ops has no DeepEP")
    return (f"; {where}: PaddleFormers' fused_dispatch / fused_combine (transformers.token_dispatcher and "
            "fused_a2a; the Flex token dispatcher of DeepSeek-V3, of GLM4-MoE's Flex layer and of the modular MoE "
            "layer's \"deepep\") run on gloo groups by the plugin's exchange at the import of token_dispatcher "
            "(deepep_standin, common.deepep_gloo)")


def _fix_sdpa_attention(patcher: Patcher, sdpa_attention) -> None:
    """Sink attention on CPU (:mod:`.sink_attention`), on a verified PaddleFormers."""
    if version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        from . import sink_attention

        sink_attention.apply_to(patcher, sdpa_attention)


def _on_verified_version(what: str, otherwise: str) -> bool:
    """Whether the installed PaddleFormers is one the fixes were verified on; else a warning naming ``what`` and
    what is ``otherwise`` done, and the switch that silences it."""
    version = _paddleformers_version()
    if version_supported(version, VERIFIED_PADDLEFORMERS):
        return True
    warnings.warn(f"{what}: written for PaddleFormers {describe_versions(VERIFIED_PADDLEFORMERS)}, this is {version}; "
                  f"{otherwise}. {COMPONENT.off_switch} silences this.", RuntimeWarning, stacklevel=3)
    return False


def _fix_moe_communication(patcher: Patcher, moe_communication) -> None:
    """The all-to-all expert order (:mod:`.moe_alltoall_order`), on a verified PaddleFormers; on
    another version a warning (the module is imported without the trainer by a model of one's own)."""
    if not _on_verified_version("paddle_hybrid.dygraph.paddleformers_fixes.moe_alltoall_order",
                                "AllToAllMoECommunication is left as it is"):
        return
    from . import moe_alltoall_order

    moe_alltoall_order.apply_to(patcher, moe_communication)


def _fix_moe_host_load(patcher: Patcher, utils) -> None:
    """ERNIE-4.5-MoE's asynchronous offload (:mod:`.moe_cpu_ops`), on a verified PaddleFormers."""
    if version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        from . import moe_cpu_ops

        moe_cpu_ops.apply_to_utils(patcher, utils)


def _fix_ernie_moe_checkpoint(patcher: Patcher, module, which: str) -> None:
    """ERNIE-4.5-MoE's saved configuration and conversion rules (:mod:`.ernie_moe_checkpoint`), on a
    verified PaddleFormers."""
    if version_supported(_paddleformers_version(), VERIFIED_PADDLEFORMERS):
        from . import ernie_moe_checkpoint

        (ernie_moe_checkpoint.apply_to_config if which == "config" else ernie_moe_checkpoint.apply_to)(patcher, module)


def apply(config, patcher: Patcher) -> str:
    from ...common.import_hook import when_imported

    cancel = when_imported(TRAINER_MODULE, lambda module: _fix_trainer(patcher, module))
    patcher.on_revert(cancel, f"the wait for {TRAINER_MODULE}")
    cancel = when_imported(EMBEDDING_MODULE, lambda module: _fix_embedding(patcher, module))
    patcher.on_revert(cancel, f"the wait for {EMBEDDING_MODULE}")
    cancel = when_imported(PIPE_MODULE, lambda module: _fix_pipe_models(patcher, module))
    patcher.on_revert(cancel, f"the wait for {PIPE_MODULE}")
    cancel = when_imported(SDPA_MODULE, lambda module: _fix_sdpa_attention(patcher, module))
    patcher.on_revert(cancel, f"the wait for {SDPA_MODULE}")
    cancel = when_imported(MOE_COMMUNICATION_MODULE, lambda module: _fix_moe_communication(patcher, module))
    patcher.on_revert(cancel, f"the wait for {MOE_COMMUNICATION_MODULE}")
    cancel = when_imported(MOE_UTILS_MODULE, lambda module: _fix_moe_host_load(patcher, module))
    patcher.on_revert(cancel, f"the wait for {MOE_UTILS_MODULE}")
    for name, which in ((ERNIE_MOE_CONFIG_MODULE, "config"), (ERNIE_MOE_MODULE, "modeling")):
        cancel = when_imported(name, lambda module, which=which: _fix_ernie_moe_checkpoint(patcher, module, which))
        patcher.on_revert(cancel, f"the wait for {name}")
    _hook_families(patcher)
    return (f"fixes {TRAINER_MODULE} when it is imported (PaddleFormers {describe_versions(VERIFIED_PADDLEFORMERS)})"
            f"{MOE_NOTE}{_standins_note()}{_deepep_note()}")


# Verified on Paddle 3.2 and 3.3: the wait for the import itself (PaddleFormers 1.2 imports only on Paddle >= 3.3).
COMPONENT = Component("paddleformers_fixes", ("3.2.", "3.3."), "paddleformers_fixes", apply)
