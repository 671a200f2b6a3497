"""ERNIE-4.5-MoE checkpoints of configurations without the correction bias or shared experts.

A model built with ``moe_use_aux_free=False`` (no ``moe_statics.e_score_correction_bias``) and
written with ``save_pretrained`` does not load back: ``from_pretrained`` stops with "ValueError:
model.layers.1.mlp.moe_statics.e_score_correction_bias should be assigned before!".  Two defects:

1. ``Ernie4_5_MoeConfig`` registers ``moe_use_aux_free`` as an unsavable key (with the run-time
   keys ``moe_group``, ``moe_rank``, ...), so ``config.json`` never records it and the loaded
   configuration has the default, ``True``: the model built to load into has the correction
   bias, the checkpoint has none.  Here the key is saved (it decides which weights exist).
   ``config.json`` gains ``"moe_use_aux_free": false``; PaddleFormers reads it back as any key.
2. The conversion rules below name the bias even for a model without it.

PaddleFormers 1.2 saves and loads ERNIE-4.5-MoE through flex-checkpoint conversion rules
(``Ernie4_5_MoePretrainedModel._gen_aoa_config`` for ``from_pretrained``,
``_gen_inv_aoa_config`` for ``save_pretrained``): one statement per kind of weight, for every
layer.  Two kinds are built only by some configurations, but their statements are always
emitted:

* ``mlp.moe_statics.e_score_correction_bias`` exists only with ``moe_use_aux_free`` true: a model
  saved with it false does not load back ("ValueError: model.layers.1.mlp.moe_statics.
  e_score_correction_bias should be assigned before!" in ``from_pretrained``);
* ``mlp.shared_experts.*`` exists only with ``moe_num_shared_experts`` > 0: a model without shared
  experts cannot be saved ("model.layers.1.mlp.shared_experts.gate_proj.weight should be assigned
  before!" in ``save_pretrained``).

What this does: both functions (and the pipeline model's copies, ``Ernie4_5_MoeForCausalLMPipe``)
drop the statements naming a kind of weight the configuration does not build; every other
statement is PaddleFormers' own.  A configuration that builds both gets exactly PaddleFormers'
rules.  On every device (the rules do not depend on it).
"""
from __future__ import annotations

import functools

__all__ = ["MODULE", "CONFIG_MODULE", "SAVED_KEYS", "apply_to", "apply_to_config", "absent_kinds", "keep"]

MODULE = "paddleformers.transformers.ernie4_5_moe.modeling"
CONFIG_MODULE = "paddleformers.transformers.ernie4_5_moe.configuration"
# keys PaddleFormers registers as unsavable that decide which weights a model has: saved
SAVED_KEYS = ("moe_use_aux_free",)
BASE = "Ernie4_5_MoePretrainedModel"
PIPE = "Ernie4_5_MoeForCausalLMPipe"
CAUSAL = "Ernie4_5_MoeForCausalLM"


def absent_kinds(config) -> list:
    """The parts of a weight name (``".moe_statics."``, ``".shared_experts."``) that ``config``
    builds no weight for."""
    kinds = []
    if not getattr(config, "moe_use_aux_free", False):
        kinds.append(".moe_statics.")
    if not getattr(config, "moe_num_shared_experts", 0):
        kinds.append(".shared_experts.")
    return kinds


def keep(statements, config) -> list:
    """``statements`` without those naming a kind of weight ``config`` does not build."""
    kinds = absent_kinds(config)
    return [s for s in statements if not any(kind in s for kind in kinds)]


def _wrap(original):
    function = original.__func__

    @functools.wraps(function)
    def gen(cls, config):
        aoa = function(cls, config)
        aoa["aoa_statements"] = keep(aoa["aoa_statements"], config)
        return aoa

    return classmethod(gen)


def apply_to(patcher, modeling) -> None:
    base = patcher.require(modeling, BASE, MODULE)
    for name in ("_gen_aoa_config", "_gen_inv_aoa_config"):
        patcher.require(base, name, f"{MODULE}.{BASE}")
        if not isinstance(vars(base).get(name), classmethod):
            from ...registry.patching import PatchSignatureError

            raise PatchSignatureError(f"{MODULE}.{BASE}.{name} is not a classmethod; unexpected PaddleFormers.")
        patcher.set(base, name, _wrap(vars(base)[name]))
    pipe = getattr(modeling, PIPE, None)
    causal = getattr(modeling, CAUSAL, None)
    if pipe is not None and causal is not None:
        for name in ("_gen_aoa_config", "_gen_inv_aoa_config"):
            if name in vars(pipe):  # bound to the causal LM when the class was made: bind the new one
                patcher.set(pipe, name, getattr(causal, name))


def _make_config_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        unsavable = getattr(self, "_unsavable_keys", None)
        if isinstance(unsavable, set):
            unsavable.difference_update(SAVED_KEYS)

    return __init__


def apply_to_config(patcher, configuration) -> None:
    """``Ernie4_5_MoeConfig``: :data:`SAVED_KEYS` are written to ``config.json``."""
    config_class = patcher.require(configuration, "Ernie4_5_MoeConfig", CONFIG_MODULE)
    patcher.set(config_class, "__init__", _make_config_init(config_class.__init__))
