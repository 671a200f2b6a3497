"""Flex checkpoints: a tied weight's optimizer state is saved under one of its names only, so a
layout that holds it under another name resumes it with fresh moments (a warning, no error).

A weight used in two places (LLaMA's embedding and output layer with ``tie_word_embeddings``)
is one parameter under two structured names.  ``AdamW.sharded_state_dict`` names its Adam state
after the first of them in sorted order (``lm_head.weight.moment1_0``, ...).  With tensor
parallel or one process every rank holds both names, so save and load agree.  A pipeline cuts the
names apart: stage 0 holds the weight as ``model.embed_tokens.weight`` only, the last stage as
``lm_head.weight`` only (PaddleFormers maps the stage's shared layer to one-process names).
Resuming a TP2 checkpoint in PP2, stage 0 asks for ``model.embed_tokens.weight.moment1_0``, the
loader logs "Missing keys" and the embedding's Adam moments restart from zero: the step after
resume differs from the uninterrupted run (seen: 6.5e-4 in the loss at step 4).

Two fixes, both on every device:

1. **Every name of a tied weight carries its state.**  ``sharded_state_dict`` of ``AdamW`` (and of
   the sharding V2 optimizer, which names states the same way; V1 hands the call to its AdamW) adds, for each further name of a
   tied parameter, an entry for the same state tensor under that name (its offsets from that
   name's model entry).  A checkpoint saved so holds the state under every name; a load asks for
   every name the rank holds, and all of them land in the one tensor (equal values: in a pipeline
   the stages' copies of a shared weight are updated alike).
2. **A missing optimizer-state entry is an error.**  A checkpoint saved without fix 1 (or by
   another tool) may still lack the name a layout asks for.  ``get_rank_to_files``, where every
   load strategy of ``dcp.load_state_dict`` finds what the checkpoint lacks, raises
   :class:`MissingOptimizerStateError` naming the entries, instead of the warning after which the
   state silently starts from zero.  Model weights that are missing keep Paddle's warning.
"""
from __future__ import annotations

import copy
import functools

from ...common.checkpoint_state import OPTIMIZER_STATE_SUFFIXES, MissingOptimizerStateError

__all__ = ["apply", "MissingOptimizerStateError", "OPTIMIZER_STATE_SUFFIXES"]


def _split_state_key(key: str):
    for suffix in OPTIMIZER_STATE_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return None, None


def _names_by_tensor(model_sharded_state_dict) -> dict:
    """Parameter tensor name -> every structured name it has here, sorted."""
    names: dict = {}
    for key in sorted(model_sharded_state_dict):
        names.setdefault(model_sharded_state_dict[key].local_tensor.name, []).append(key)
    return names


def add_tied_names(optimizer_state: dict, model_sharded_state_dict: dict) -> dict:
    """``optimizer_state`` with each tied parameter's entries repeated under its other names."""
    names = _names_by_tensor(model_sharded_state_dict)
    aliases = {group[0]: group[1:] for group in names.values() if len(group) > 1}
    if not aliases:
        return optimizer_state
    out = dict(optimizer_state)
    for key, entry in optimizer_state.items():
        struct, suffix = _split_state_key(key)
        for alias in aliases.get(struct, ()):
            alias_key = alias + suffix
            if alias_key in out:
                continue
            twin = copy.copy(entry)
            twin.key = alias_key
            if tuple(entry.global_shape) == tuple(model_sharded_state_dict[alias].global_shape):
                twin.global_offset = model_sharded_state_dict[alias].global_offset
            out[alias_key] = twin
    return out


def _make_sharded_state_dict(stock):
    @functools.wraps(stock)
    def sharded_state_dict(self, model_sharded_state_dict, *args, **kwargs):
        return add_tied_names(stock(self, model_sharded_state_dict, *args, **kwargs), model_sharded_state_dict)

    return sharded_state_dict


def _make_get_rank_to_files(stock):
    @functools.wraps(stock)
    def get_rank_to_files(*args, **kwargs):
        result = stock(*args, **kwargs)
        missing = sorted(k for k in result[1] if _split_state_key(k)[0] is not None)
        if missing:
            raise MissingOptimizerStateError(
                f"paddle_hybrid: the flex checkpoint has no optimizer state for {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} ({len(missing)} entries); loading would restart them from "
                "zero. Causes: a tied weight saved under another name by a version without "
                "paddle_hybrid.dygraph.fleet_fixes.tied_optimizer_state, or a checkpoint of another model. Resume "
                "without optimizer state on purpose (PaddleFormers: --ignore_load_lr_and_optim) or save the "
                "checkpoint again with the plugin installed.")
        return result

    return get_rank_to_files


def apply(config, patcher) -> None:
    import importlib

    import paddle

    load_module = importlib.import_module("paddle.distributed.flex_checkpoint.dcp.load_state_dict")
    sharding = importlib.import_module(
        "paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer")
    owners = [(paddle.optimizer.AdamW, "paddle.optimizer.AdamW"),
              (sharding.DygraphShardingOptimizerV2, "DygraphShardingOptimizerV2")]
    stocks = []
    for owner, where in owners:
        stock = patcher.require(owner, "sharded_state_dict", where)
        patcher.check_params(stock, ["self", "model_sharded_state_dict"], f"{where}.sharded_state_dict")
        stocks.append(stock)
    get_rank_to_files = patcher.require(load_module, "get_rank_to_files", "dcp.load_state_dict")
    for (owner, _), stock in zip(owners, stocks):
        patcher.set(owner, "sharded_state_dict", _make_sharded_state_dict(stock))
    patcher.set(load_module, "get_rank_to_files", _make_get_rank_to_files(get_rank_to_files))
