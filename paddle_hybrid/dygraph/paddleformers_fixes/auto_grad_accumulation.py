"""The auto-parallel Trainer (``--enable_auto_parallel 1``) sums accumulated gradients where the
fleet Trainer averages them.

PaddleFormers 1.2: with ``gradient_accumulation_steps`` k > 1, ``Trainer.train`` divides every
gradient by k before the optimizer step (``p.grad.scale_(1 / k)``), but only ``if not
args.enable_auto_parallel``; the auto-parallel path has no division of its own (it does not use
Paddle's ``shard_optimizer``, whose ``gradient_accumulation_steps`` would divide).  Its update
then uses k times the mean gradient, on every device: AdamW hides most of it (it divides by the
gradients' scale, except for its epsilon), clipping at ``max_grad_norm`` does not, and every
other optimizer takes a k times larger step.  Tiny LLaMA, DP2, k = 2, ``adam_epsilon`` 1.0:
step 2 loss 4.775 where one process and fleet DP2 give 4.932.

The auto-parallel Trainer keeps its gradients in the fused buffers of Paddle's ``fully_shard``
(the parameters' own ``grad`` hold nothing then), which the optimizer reads at its step.

Fix: ``Trainer.optimizer_step`` in auto-parallel mode with k > 1 first divides each gradient by k,
as the fleet path does just before the same call: the fused buffers where ``fully_shard`` holds
them (its pending reduce-scatters completed first).  Gradients anywhere else (not 1.2's Trainer)
are an error naming the switch, not a guess.
"""
from __future__ import annotations

import functools

from ...common.grad_tools import divide_fused_fsdp_grads

__all__ = ["fix"]


def _average(steps: int) -> None:
    fsdp = _fsdp_context()
    if fsdp is None:  # PaddleFormers 1.2 wraps every auto-parallel model in fully_shard
        raise RuntimeError(
            "paddle_hybrid.dygraph.paddleformers_fixes: the auto-parallel Trainer's gradients are not in Paddle's "
            "fused FSDP buffers, where PaddleFormers 1.2 keeps them; this Trainer differs and its accumulated "
            "gradients cannot be averaged here. Set PADDLE_HYBRID_PADDLEFORMERS_FIXES=0 to run without the fixes "
            "(accumulated gradients are then summed), or --gradient_accumulation_steps 1.")
    divide_fused_fsdp_grads(fsdp, steps)


def _fsdp_context():
    try:
        from paddle.distributed.auto_parallel.fully_shard_fusion import get_fsdp_context
    except ImportError:  # a Paddle without fused FSDP
        return None
    return get_fsdp_context()


def _make_optimizer_step(stock):
    @functools.wraps(stock)
    def optimizer_step(self, args, model, parameters_list=None):
        if args.enable_auto_parallel and args.gradient_accumulation_steps > 1 and not args.freeze_training:
            _average(args.gradient_accumulation_steps)
        return stock(self, args, model, parameters_list)

    return optimizer_step


def fix(patcher, trainer_module) -> None:
    trainer_cls = patcher.require(trainer_module, "Trainer", "paddleformers.trainer.trainer")
    stock = patcher.require(trainer_cls, "optimizer_step", "paddleformers Trainer")
    patcher.check_params(stock, ["self", "args", "model", "parameters_list"], "Trainer.optimizer_step")
    patcher.set(trainer_cls, "optimizer_step", _make_optimizer_step(stock))
