"""``FLAGS_use_cuda_malloc_async_allocator`` set at ``import paddle_hybrid`` (component
``cuda_malloc_async``, ``PluginConfig.cuda_malloc_async``, ``PADDLE_HYBRID_CUDA_MALLOC_ASYNC=1``).

CUDA graphs capture allocations; the stream-ordered allocator lets captured graphs share memory
with the rest of the run.  Paddle reads the flag once, when it builds the GPU allocator, so the
plugin sets it at import (before any GPU tensor exists, if the plugin is imported first), warns
when GPU memory was already handed out, and restores the old value at uninstall.

An opt-in on every build (:mod:`paddle_hybrid.registry.gate`, kind ``opt_in``): written against
Paddle's documented flag API and never run on a GPU.  ``allow_unrun`` does not set it: it
changes Paddle's allocator, not a path of the plugin.
"""
from __future__ import annotations

import warnings

from ...registry import device
from ...registry.component import Component

__all__ = ["COMPONENT", "apply", "FLAG"]

FLAG = "FLAGS_use_cuda_malloc_async_allocator"


def _flag_value():
    import paddle

    try:
        return paddle.get_flags([FLAG])[FLAG]
    except ValueError as exc:  # what paddle.get_flags raises for a flag this build does not have
        raise RuntimeError(
            f"paddle_hybrid: PluginConfig.cuda_malloc_async is set but this Paddle has no {FLAG} ({exc})."
        ) from exc


def _gpu_memory_allocated() -> bool:
    """Whether the GPU allocator already handed out memory, so setting the flag comes too late.

    No GPU (a CPU build, or no device visible) means no allocator yet: False without asking.  If
    asking fails, that is reported as a warning naming the call (the flag is still set: it is
    only the check that could not run)."""
    import paddle

    if device.cuda_devices() == 0:
        return False
    try:
        return paddle.device.cuda.memory_allocated() > 0
    except Exception as exc:  # reported, not swallowed: the flag works, the check did not
        warnings.warn(
            f"paddle_hybrid: could not tell whether GPU memory was already allocated before setting "
            f"{FLAG}: paddle.device.cuda.memory_allocated() raised {exc!r}. If GPU tensors exist "
            "already, the flag has no effect.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False


def apply(config, patcher) -> None:
    """Phases: read the old value (refused where the build has no such flag), warn if it is too
    late, set it; restored at undo."""
    import paddle

    before = _flag_value()
    if _gpu_memory_allocated():
        warnings.warn(
            f"paddle_hybrid: {FLAG} set after GPU memory was already allocated; Paddle reads it "
            "once when it builds the GPU allocator, so it may have no effect. Import paddle_hybrid "
            "before creating any GPU tensor.",
            stacklevel=3,
        )
    paddle.set_flags({FLAG: True})
    patcher.on_revert(lambda: paddle.set_flags({FLAG: before}), FLAG)


COMPONENT = Component("cuda_malloc_async", ("3.2.", "3.3."), "cuda_malloc_async", apply)
