"""A checkpoint's small files in a dry run's fake world: each rank looks at the disk itself.

Why: the Trainer's resume finds a checkpoint's scheduler, scaler and trainer state through
``distributed_isfile`` and ``distributed_file`` (``paddleformers.trainer.utils.helper``).  The first
asks only each node's first rank and sums the answers with an ``all_reduce``; the second gathers
which rank holds the file, broadcasts its bytes and lets each node's first rank write them.  In the
fake world (:mod:`paddle_hybrid.gloo.fake_world`) an ``all_reduce`` gives this rank's own count
back, so a class's representative that is not its node's first rank (rank 2, stage 1's of tp2 x
pp2 on one node) found no scheduler (``ValueError: scheduler-file not found``), and the gather
named no holder.  Both are exchanges whose answer depends on other ranks' disks.

What: in a fake world only (installed only there), both answer from this process's view of the
disk, as PaddleFormers' one-process path does: the dry run runs every rank on this machine, with
the checkpoint the job would read.  ``distributed_isfile``: whether the file (or, for a ``.json`` or
``.bin`` name, either of the two) is there; ``distributed_file``: the name to read (``.json`` before
``.bin``).  Replaced where PaddleFormers' modules hold the names (``trainer``, ``trainer_utils``,
the unified checkpoint's modules, ``helper`` itself).
"""
from __future__ import annotations

import functools
import os
import sys

__all__ = ["fix", "HELPER_MODULE", "candidates"]

HELPER_MODULE = "paddleformers.trainer.utils.helper"


def candidates(filename: str) -> list:
    """The names PaddleFormers accepts for ``filename``: a ``.json`` or ``.bin`` state under either suffix."""
    if filename.endswith((".json", ".bin")):
        stem = os.path.splitext(filename)[0]
        return [stem + ".json", stem + ".bin"]
    return [filename]


def _make_isfile(stock, active):
    @functools.wraps(stock)
    def distributed_isfile(filename):
        if not active():
            return stock(filename)
        return any(os.path.isfile(name) for name in candidates(filename))

    return distributed_isfile


def _make_file(stock, active):
    @functools.wraps(stock)
    def distributed_file(filename):
        if not active():
            return stock(filename)
        return next((name for name in candidates(filename) if os.path.isfile(name)), filename)

    return distributed_file


def fix(patcher, trainer_module) -> None:
    """Phases: nothing outside a fake world; check both helpers' parameters; replace them in every
    PaddleFormers module that holds them."""
    from ...gloo import fake_world

    if not fake_world.active():
        return
    import importlib

    helper = importlib.import_module(HELPER_MODULE)
    for name, make in (("distributed_isfile", _make_isfile), ("distributed_file", _make_file)):
        stock = patcher.require(helper, name, HELPER_MODULE)
        patcher.check_params(stock, ["filename"], f"{HELPER_MODULE}.{name}")
        replacement = make(stock, fake_world.active)
        for module_name, module in sorted(sys.modules.items()):
            if module is not None and module_name.startswith("paddleformers.") and \
                    getattr(module, name, None) is stock:
                patcher.set(module, name, replacement)
