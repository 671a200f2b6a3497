"""The Trainer's flex-checkpoint resume (``Trainer._load_flex_checkpoint``): two defects, and a resume
refused (a fused gate/up projection at another tensor-parallel degree: :mod:`.fused_gate_up_resume`).

Silent fresh moments: the resume gives a parameter fresh optimizer moments, silently, when
the checkpoint holds no state under the name this layout gives it.

``Trainer._load_flex_checkpoint`` first creates optimizer accumulators (``init_optimizer``) only
for parameters whose state it finds in the checkpoint's metadata, then loads those.  A parameter
whose name is absent is skipped without a word, and the first step after resume creates its
Adam moments from zero.  That is what happens to a tied embedding resumed in a pipeline from a
checkpoint saved in another layout (``paddle_hybrid.dygraph.fleet_fixes.tied_optimizer_state`` saves the
state under every name of a tied weight, so checkpoints saved with the plugin do not hit this).

Fix: before ``init_optimizer`` runs, when the checkpoint holds optimizer state at all, every
trainable parameter must have some under one of its names here; otherwise
:class:`~paddle_hybrid.common.checkpoint_state.MissingOptimizerStateError` names them.
A resume with ``--ignore_load_lr_and_optim`` (the Trainer loads no optimizer state) is not
checked.

One process: the same method asks ``fleet.get_hybrid_communicate_group()`` first, but on one
process the Trainer never calls ``fleet.init``, so a checkpoint saved in any layout cannot be
resumed there (``'Fleet' object has no attribute '_hcg'``).  The hybrid group is used only by
the ``parallel_broadcast`` load strategy, which needs a pipeline group and says so.  While this
method runs on a fleet that was never initialised, ``paddle.distributed.fleet.
get_hybrid_communicate_group()`` answers None (every other caller, and every initialised fleet,
gets Paddle's method).
"""
from __future__ import annotations

import functools
import threading

from ...common.checkpoint_state import MOMENT_SUFFIXES, MissingOptimizerStateError
from ...registry.patching import PatchSignatureError
from . import fused_gate_up_resume

__all__ = ["apply", "check_state_found"]

_loading = threading.local()  # .active, .ignore_optimizer: while a Trainer's flex checkpoint loads


def check_state_found(model_sharded_state_dict, state_dict_metadata) -> None:
    """Raise if the metadata holds optimizer moments but none for some trainable parameter."""
    if not any(key.endswith(MOMENT_SUFFIXES) for key in state_dict_metadata):
        return  # a checkpoint without optimizer state: nothing to place
    names: dict = {}
    for key in sorted(model_sharded_state_dict):
        tensor = model_sharded_state_dict[key].local_tensor
        if not tensor.stop_gradient:
            names.setdefault(tensor.name, []).append(key)
    missing = [group for group in names.values()
               if not any(n + suffix in state_dict_metadata for n in group for suffix in MOMENT_SUFFIXES)]
    if missing:
        raise MissingOptimizerStateError(
            f"paddle_hybrid: the checkpoint has optimizer state, but none for the parameters {missing[:8]} "
            f"as this layout names them ({len(missing)} parameters); resuming would restart their moments from "
            "zero. A tied weight saved in another layout without paddle_hybrid names its state after one name "
            "only: save the checkpoint again with the plugin installed, or resume without optimizer state "
            "on purpose with --ignore_load_lr_and_optim.")


def _make_init_optimizer(stock):
    @functools.wraps(stock)
    def init_optimizer(optimizer, model_sharded_state_dict, state_dict_metadata):
        if not getattr(_loading, "ignore_optimizer", False):
            check_state_found(model_sharded_state_dict, state_dict_metadata)
        return stock(optimizer, model_sharded_state_dict, state_dict_metadata)

    return init_optimizer


def _make_load_flex_checkpoint(stock):
    @functools.wraps(stock)
    def _load_flex_checkpoint(self, resume_from_checkpoint):
        held = (getattr(_loading, "ignore_optimizer", False), getattr(_loading, "active", False))
        _loading.ignore_optimizer = bool(getattr(self.args, "ignore_load_lr_and_optim", False))
        _loading.active = True
        try:
            fused_gate_up_resume.check(self.model, resume_from_checkpoint)  # before anything loads
            return stock(self, resume_from_checkpoint)
        finally:
            _loading.ignore_optimizer, _loading.active = held

    return _load_flex_checkpoint


def _make_get_hcg(stock, fleet_singleton):
    """Fleet's module-level ``get_hybrid_communicate_group`` (a method bound to the singleton at
    import, so the class attribute alone would not reach it)."""

    @functools.wraps(stock)
    def get_hybrid_communicate_group():
        if getattr(_loading, "active", False) and getattr(fleet_singleton, "_hcg", None) is None:
            return None  # one process, fleet.init never called: there is no hybrid group
        return stock()

    return get_hybrid_communicate_group


def fix(patcher, trainer_module) -> None:
    import importlib

    fleet_package = importlib.import_module("paddle.distributed.fleet")

    utils = importlib.import_module("paddleformers.trainer.trainer_utils")
    stock_init = patcher.require(utils, "init_optimizer", "paddleformers.trainer.trainer_utils")
    patcher.check_params(stock_init, ["optimizer", "model_sharded_state_dict", "state_dict_metadata"],
                         "paddleformers init_optimizer")
    trainer_cls = patcher.require(trainer_module, "Trainer", "paddleformers.trainer.trainer")
    stock_load = patcher.require(trainer_cls, "_load_flex_checkpoint", "paddleformers Trainer")
    patcher.check_params(stock_load, ["self", "resume_from_checkpoint"], "Trainer._load_flex_checkpoint")
    replacement = _make_init_optimizer(stock_init)
    patcher.set(utils, "init_optimizer", replacement)
    if getattr(trainer_module, "init_optimizer", None) is stock_init:  # the trainer's own imported name
        patcher.set(trainer_module, "init_optimizer", replacement)
    stock_hcg = patcher.require(fleet_package, "get_hybrid_communicate_group", "paddle.distributed.fleet")
    singleton = getattr(stock_hcg, "__self__", None)
    if singleton is None or singleton is not patcher.require(fleet_package, "fleet", "paddle.distributed.fleet"):
        raise PatchSignatureError(f"{patcher.component}: paddle.distributed.fleet.get_hybrid_communicate_group is not "
                                  f"the fleet singleton's method; unexpected Paddle. Set {patcher.off_switch} to run "
                                  "without these fixes.")
    patcher.set(trainer_cls, "_load_flex_checkpoint", _make_load_flex_checkpoint(stock_load))
    patcher.set(fleet_package, "get_hybrid_communicate_group", _make_get_hcg(stock_hcg, singleton))
