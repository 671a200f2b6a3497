"""``Trainer._wrap_distributed_optimizer`` with clipping on: ``'AdamW' object has no attribute
'_inner_opt'``.

PaddleFormers 1.2's Trainer wraps the optimizer with ``fleet.distributed_optimizer`` and, when
the result is a ``HybridParallelOptimizer`` and ``max_grad_norm > 0`` (its default is 1.0),
replaces the global-norm function of the optimizer's clip so the norm lands in the training
logs.  The replacement is bound to ``dist_optimizer._inner_opt._grad_clip`` but assigned through
``self.optimizer._inner_opt``: at that point ``self.optimizer`` is still the unwrapped
optimizer, which has no ``_inner_opt``.  Nothing there depends on the device: every TP, PP or
sharding run with clipping stops in ``Trainer.train`` on any device.

Fix: while the method runs, ``self.optimizer`` is a stand-in that catches that one assignment;
after it returns, the caught function is put where it is bound (``dist_optimizer._inner_opt.
_grad_clip``), which is what the line means: the norm computation itself is Paddle's, called
unchanged by PaddleFormers' function, which only records the value in the logs.  If the caught
function is bound to anything else, the fix raises instead of guessing.
"""
from __future__ import annotations

import functools
import types

__all__ = ["apply"]


def _stand_in():
    """Catches ``<stand-in>._inner_opt._grad_clip._global_norm = ...``."""
    clip = types.SimpleNamespace()
    return types.SimpleNamespace(_inner_opt=types.SimpleNamespace(_grad_clip=clip)), clip


def _make_wrap(stock):
    @functools.wraps(stock)
    def _wrap_distributed_optimizer(self, optimizer):
        held = self.__dict__.get("optimizer")
        stand_in, caught = _stand_in()
        self.optimizer = stand_in
        try:
            dist_optimizer = stock(self, optimizer)
        finally:
            self.optimizer = held
        hook = vars(caught).get("_global_norm")
        if hook is not None:
            clip = dist_optimizer._inner_opt._grad_clip
            if getattr(hook, "__self__", None) is not clip:
                raise RuntimeError(
                    "paddle_hybrid.dygraph.paddleformers_fixes: Trainer._wrap_distributed_optimizer bound its global-norm "
                    "function to another object than the wrapped optimizer's clip; this PaddleFormers differs "
                    "from 1.2. Set PADDLE_HYBRID_PADDLEFORMERS_FIXES=0 to run without this fix.")
            clip._global_norm = hook
        return dist_optimizer

    return _wrap_distributed_optimizer


def fix(patcher, trainer_module) -> None:
    trainer_cls = patcher.require(trainer_module, "Trainer", "paddleformers.trainer.trainer")
    stock = patcher.require(trainer_cls, "_wrap_distributed_optimizer", "paddleformers Trainer")
    patcher.check_params(stock, ["self", "optimizer"], "Trainer._wrap_distributed_optimizer")
    patcher.set(trainer_cls, "_wrap_distributed_optimizer", _make_wrap(stock))
