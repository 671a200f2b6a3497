"""Device: ``PipelineLayer`` reads ``ParallelEnv().device_id``, which Paddle sets only for
CUDA/XPU/custom devices (``AttributeError: ... '_device_id'`` on CPU).

Patch: a class-level default ``ParallelEnv._device_id = 0``.
"""
from __future__ import annotations

__all__ = ["apply"]


def apply(patcher) -> None:
    import paddle.distributed.parallel as parallel

    if "_device_id" not in vars(parallel.ParallelEnv):
        patcher.set(parallel.ParallelEnv, "_device_id", 0)
