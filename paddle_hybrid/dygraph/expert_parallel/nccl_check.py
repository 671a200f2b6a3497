"""``MoELayer`` on a build without NCCL.

``MoELayer.__init__`` calls ``check_nccl_version_for_p2p()`` whenever its MoE group has more
than one rank (unless ``PADDLE_DISTRI_BACKEND=xccl``); that reads ``core.nccl_version()``, which
a CPU build does not have (``module 'paddle.base.libpaddle' has no attribute 'nccl_version'``).
The check guards against NCCL versions before 2.8.4, whose p2p had bugs; with no NCCL in the
build there is nothing to check.  Patch: the name ``check_nccl_version_for_p2p`` in
``moe_layer`` returns at once on a build without ``nccl_version`` and calls Paddle's check on any
other build.
"""
from __future__ import annotations

import functools

__all__ = ["apply"]


def _make(original):
    @functools.wraps(original)
    def check_nccl_version_for_p2p():
        from paddle.base import core

        if not hasattr(core, "nccl_version"):
            return None  # no NCCL in this build: its p2p bugs cannot apply
        return original()

    return check_nccl_version_for_p2p


def apply(config, patcher) -> None:
    import importlib

    moe_layer = importlib.import_module("paddle.incubate.distributed.models.moe.moe_layer")
    original = patcher.require(moe_layer, "check_nccl_version_for_p2p", "moe_layer")
    patcher.check_params(original, [], "moe_layer.check_nccl_version_for_p2p")
    patcher.set(moe_layer, "check_nccl_version_for_p2p", _make(original))
