"""Flex checkpoints (``paddle.distributed.save_state_dict`` / ``load_state_dict``, the
``dcp`` package) on CPU.

Loading a checkpoint into another layout reshards it: ranks broadcast or send the pieces each
other needs.  Every communicator of ``paddle.distributed.flex_checkpoint.dcp`` first moves
its buffers to the GPU (``if not t.place.is_gpu_place(): t = t.cuda()``, ``t.cuda().pin_memory()``,
a ``.cuda()`` before a broadcast), so on a CPU build a reshard stops at ``ValueError: No
available device found``; loading into one process, which needs no exchange, works.  The same
load is reached from PaddleFormers' ``from_pretrained`` (its default flex-checkpoint format) and
from the Trainer's resume.

Patch: ``Tensor.cuda`` and ``Tensor.pin_memory`` answer "the CPU" when, and only when, (1) the
caller is a module of the ``dcp`` package, (2) this build has no CUDA (``.cuda()`` could only
raise) and (3) the tensor is in host memory: they return a copy in host memory, as ``.cuda()``
returns a copy on the device, so every later step of the communicator (the cross-device copy
back into the target, the broadcast over gloo) runs unchanged.  Any other caller, build or
tensor gets Paddle's method.  The caller is read from the calling frame's module name: the
communicators' ``.cuda()`` calls sit in a dozen methods of three modules, and naming them one
by one would miss the next one Paddle adds.
"""
from __future__ import annotations

import functools
import sys

__all__ = ["apply", "DCP_PACKAGE"]

DCP_PACKAGE = "paddle.distributed.flex_checkpoint.dcp"


def _asked_by_dcp() -> bool:
    """Is the first frame outside this plugin (its replacement and the Patcher's link) in dcp?"""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("paddle_hybrid."):
        frame = frame.f_back
    caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    return caller == DCP_PACKAGE or caller.startswith(DCP_PACKAGE + ".")


def _answer_cpu(tensor) -> bool:
    from ...registry.device import accelerator_build, on_cpu

    return accelerator_build() is None and on_cpu(tensor)


def _host_copy(tensor):
    import paddle

    copy = tensor._copy_to(paddle.CPUPlace(), True)
    copy.stop_gradient = tensor.stop_gradient
    return copy


def _make_to_device(stock):
    """``Tensor.cuda`` / ``Tensor.pin_memory``: a host copy when dcp asks on a CPU build."""

    @functools.wraps(stock)
    def to_device(self, *args, **kwargs):
        if _asked_by_dcp() and _answer_cpu(self):
            return _host_copy(self)
        return stock(self, *args, **kwargs)

    return to_device


def apply(config, patcher) -> None:
    import importlib

    import paddle

    # The package this answers for must exist (its modules differ between 3.2 and 3.3: 3.3 moved
    # the exchange into reshard_comm / resharder; every one of them is in the package).
    importlib.import_module(f"{DCP_PACKAGE}.load_state_dict")
    for name in ("cuda", "pin_memory"):
        stock = patcher.require(paddle.Tensor, name, "paddle.Tensor")
        patcher.set(paddle.Tensor, name, _make_to_device(stock))
