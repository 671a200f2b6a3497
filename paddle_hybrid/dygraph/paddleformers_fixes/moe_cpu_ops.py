"""PaddleFormers 1.2's MoE layers on a CPU build: ``create_async_load`` for ``async_offload``.

ERNIE-4.5-MoE's sparse block (``nn/moe/moe_allgather_layer.py``, ``MOEAllGatherLayerV2``) copies
its per-expert token counts to the host with Paddle's asynchronous offload: ``get_async_loader()``
(``nn/moe/utils.py``) calls ``paddle.incubate.tensor.manipulation.create_async_load()``, which
returns ``core.AsyncLoad()`` on any build but XPU and custom devices; the CPU build has no
``AsyncLoad`` (``AttributeError: module 'paddle.base.libpaddle' has no attribute 'AsyncLoad'``),
and ``async_offload(tensor, loader)`` needs its ``offload``.  On the host an offload is a copy.

What this does, only on a build whose ``core`` has no ``AsyncLoad``: ``create_async_load`` as
PaddleFormers' ``nn.moe.utils`` holds it returns a :class:`HostLoad`, which does what ``AsyncLoad``
does for Paddle's own ``async_offload`` / ``async_reload`` (they call ``loader.offload(dst, src)``):
``dst`` becomes a copy of ``src`` on the CPU, and the task it returns is finished (``cpu_wait``,
``cuda_wait``, ``is_completed``), as Paddle's XPU fallback does.  ``async_offload`` itself is
Paddle's, unchanged.  On a build with ``AsyncLoad`` (GPU) nothing is replaced.

A defect on every device, mended here too: ``get_async_loader()`` keeps its loader in a module
global (``global async_loader``) that ``nn/moe/utils.py`` never defines, so in a process where
fleet was not initialised (one process, no ``fleet.init``) it stops with ``NameError: name
'async_loader' is not defined``.  The global is defined (``None``, what the function expects
before its first call) while the fixes are installed, and removed at ``uninstall()``.

The MoE ops themselves (``expand_modality_expert_id``, ``moe_gate_dispatch_partial_nosoftmaxtopk``,
``moe_combine``, ``cal_aux_loss``, ``int_bincount``, ...) are C++ kernels entered for CPU by
``paddle_hybrid.dygraph.expert_parallel.moe_kernels``: PaddleFormers reaches them through
``paddle._C_ops``.
"""
from __future__ import annotations

import functools

__all__ = ["UTILS_MODULE", "HostLoad", "HostTask", "apply_to_utils", "needed"]

UTILS_MODULE = "paddleformers.nn.moe.utils"


def needed() -> bool:
    """True on a Paddle build without ``core.AsyncLoad`` (the CPU build)."""
    from paddle.base import core

    return not hasattr(core, "AsyncLoad")


class HostTask:
    """A finished copy: every wait returns at once."""

    def is_completed(self) -> bool:
        return True

    def cpu_wait(self) -> None:
        pass

    def cuda_wait(self) -> None:
        pass

    def xpu_wait(self) -> None:
        pass

    def wait(self) -> None:
        pass


class HostLoad:
    """What ``create_async_load()`` returns on a build without ``AsyncLoad``: Paddle's
    ``async_offload`` / ``async_reload`` hand it a new tensor ``dst`` and the source; on the host
    both are a copy, finished at once."""

    def offload(self, dst, src):
        import paddle

        paddle.assign(src.detach().cpu() if not src.place.is_cpu_place() else src.detach(), output=dst)
        dst.stop_gradient = True
        return HostTask()

    reload = offload


def _make_create_async_load(original):
    @functools.wraps(original)
    def create_async_load():
        return HostLoad() if needed() else original()

    return create_async_load


def apply_to_utils(patcher, utils) -> None:
    """``nn.moe.utils.async_loader`` defined (every device); ``create_async_load``: a
    :class:`HostLoad` on a build without ``AsyncLoad``."""
    if "async_loader" not in vars(utils):
        utils.async_loader = None
        patcher.on_revert(lambda: vars(utils).pop("async_loader", None),
                          f"{UTILS_MODULE}.async_loader (defined for get_async_loader)")
    if not needed():
        return
    original = patcher.require(utils, "create_async_load", UTILS_MODULE)
    patcher.set(utils, "create_async_load", _make_create_async_load(original))
