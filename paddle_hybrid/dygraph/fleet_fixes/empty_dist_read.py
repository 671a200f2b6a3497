"""``Tensor.numpy()`` of a DistTensor whose local value was freed returns a zero-size array, no error.

Paddle 3.3.1: a DistTensor of shape ``[64, 32]`` on a mesh holding this rank, whose local value
has no storage (``_clear_data``), reads as ``numpy()`` of shape ``(64, 32, 0)``: zero elements,
no error, on every device.  Paddle's fused FSDP (``fully_shard`` in auto-parallel mode, what
PaddleFormers' ``--enable_auto_parallel`` Trainer wraps every model in) leaves every parameter so
between forwards, so a script that reads its trained weights gets empty arrays and computes on
them (a norm of 0, an all-equal comparison) without a sign.

Fix: ``Tensor.numpy`` of a DistTensor that is not initialized on a rank of its mesh, with a
non-zero shape, raises :class:`EmptyDistTensorReadError` naming the tensor and what gives it its
value.  A DistTensor on a mesh without this rank (another pipeline stage's) has no local value by
design and reads as before; so does every dense tensor (one ``is_dist()`` call is the cost).
"""
from __future__ import annotations

import functools

__all__ = ["EmptyDistTensorReadError", "apply"]


class EmptyDistTensorReadError(RuntimeError):
    """A read of a DistTensor whose value on this rank was freed."""


def _freed_here(tensor) -> bool:
    if not tensor.is_dist() or tensor._is_initialized():
        return False
    import paddle.distributed as dist

    if dist.get_rank() not in tensor.process_mesh.process_ids:
        return False
    return all(int(d) > 0 for d in tensor.shape)


def _make_numpy(stock):
    @functools.wraps(stock)
    def numpy(self, *args, **kwargs):
        if _freed_here(self):
            raise EmptyDistTensorReadError(
                f"{self.name}: a DistTensor of shape {list(self.shape)} with no value on this rank (its storage "
                "was freed); reading it would give a zero-size array. Paddle's fused FSDP (fully_shard, PaddleFormers' "
                "--enable_auto_parallel) frees every parameter between forwards. With PaddleFormers' Trainer, "
                "paddle_hybrid gathers the trained values into the parameters when train() returns and for every "
                "save; elsewhere call paddle_hybrid.common.fused_fsdp.gather_parameters("
                "paddle_hybrid.common.fused_fsdp.context()) on every rank first. (paddle_hybrid.fleet_fixes)")
        return stock(self, *args, **kwargs)

    return numpy


def apply(config, patcher) -> None:
    import paddle

    stock = patcher.require(paddle.Tensor, "numpy", "paddle.Tensor")
    patcher.set(paddle.Tensor, "numpy", _make_numpy(stock))
