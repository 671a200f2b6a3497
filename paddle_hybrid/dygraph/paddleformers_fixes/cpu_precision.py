"""``--fp16`` or ``--bf16`` on CPU stops at the start, naming the flag, instead of a silent fp32 run.

PaddleFormers 1.2's Trainer on a CPU device: with ``--bf16`` it trains in float32 and says so
only in a log line (Paddle's CPU build has no bfloat16 autocast for these models), a run that
looks like the one asked for and is not; with ``--fp16 --amp_master_grad`` it stops at the first
step with ``AttributeError: 'GradScaler' object has no attribute '_cache_found_inf'``
(``trainer.py``: Paddle's ``GradScaler`` switches itself off on CPU, and the Trainer reads state it
never set).  Neither is what a user asked for.

Fix: at ``Trainer.__init__``, on a CPU device (``args.device == "cpu"``, or a Paddle built without
an accelerator) with ``fp16`` or ``bf16`` set, a ``ValueError`` that names the flag and the way
to run (``--fp16 false --bf16 false``: float32, which is what CPU would give anyway).  Nothing
changes on an accelerator.
"""
from __future__ import annotations

__all__ = ["CpuPrecisionError", "check", "on_cpu"]


class CpuPrecisionError(ValueError):
    """A half-precision flag on a CPU device."""


def on_cpu(args) -> bool:
    """The Trainer runs on a CPU device: ``args.device`` says so, or Paddle has no accelerator."""
    import paddle

    from ...registry.device import accelerator_build

    device = str(getattr(args, "device", "") or paddle.get_device())
    return device.startswith("cpu") or accelerator_build() is None


def check(args) -> None:
    """Raise :class:`CpuPrecisionError` for ``fp16`` / ``bf16`` on a CPU device."""
    asked = [flag for flag in ("fp16", "bf16") if getattr(args, flag, False)]
    if asked and on_cpu(args):
        flags = " and ".join(f"--{flag}" for flag in asked)
        raise CpuPrecisionError(
            f"{flags} on a CPU device: PaddleFormers' Trainer would train in float32 with --bf16 (Paddle's CPU "
            f"build has no half-precision autocast for it; only a log line says so) and stops at the first step "
            f"with --fp16 (Paddle's GradScaler turns itself off on CPU). Run with --fp16 false --bf16 false "
            f"(float32) on CPU; keep {flags} for the accelerator run. (paddle_hybrid.paddleformers_fixes)")
