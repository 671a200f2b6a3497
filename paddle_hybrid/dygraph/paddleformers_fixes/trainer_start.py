"""What is checked, or carried into the model, before PaddleFormers' ``Trainer`` builds anything:
one wrapper of ``Trainer.__init__`` for :mod:`.cpu_precision` (a half-precision flag on CPU stops
here), :mod:`.auto_parallel_layouts` (auto-parallel tensor parallelism on CPU stops here),
:mod:`.segment_parallel` (segment parallelism with a PaddleFormers model stops here, on every
device) and :mod:`.recompute_flags` (the recompute flags written into the model's config).
"""
from __future__ import annotations

import functools

from . import auto_parallel_layouts, cpu_precision, recompute_flags, segment_parallel

__all__ = ["fix"]


def _make_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            cpu_precision.check(training_args)
            auto_parallel_layouts.check(training_args)
            segment_parallel.check(training_args, model)
            if model is not None:
                recompute_flags.carry(training_args, model)
        original(self, *args, **kwargs)

    return __init__


def fix(patcher, trainer_module) -> None:
    trainer_cls = patcher.require(trainer_module, "Trainer", "paddleformers.trainer.trainer")
    original = patcher.require(trainer_cls, "__init__", "paddleformers Trainer")
    patcher.set(trainer_cls, "__init__", _make_init(original))
