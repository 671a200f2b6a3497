"""``--enable_auto_parallel 1`` with ``--tensor_model_parallel_size`` > 1 stops at the start on CPU.

PaddleFormers 1.2's auto-parallel Trainer without ``--use_intermediate_api`` parallelizes nothing
itself (``parallelize_model`` is given no config), yet the model reads the tensor-parallel degree
and builds fleet's tensor-parallel layers (``ColumnParallelLinear``, vocab-parallel cross entropy),
which then get auto-parallel DistTensors.  What happens next, seen on CPU with Paddle 3.3.1:

- with the data-parallel degree 1 (plain TP2), Paddle's fused FSDP, which the Trainer wraps every
  auto-parallel model in, all-gathers over the data-parallel group of one rank, a group Paddle
  makes with no process group on every device: "The group should not be None and all ranks which
  invoke this operation should be the member of this group";
- past that (FSDP skipped, or with ``--use_intermediate_api``), the first tensor-parallel all-reduce
  hands a DistTensor to the gloo process group, which reads it as a dense tensor: stock, the
  process dies of a segmentation fault with no message (now :mod:`paddle_hybrid.gloo.errors`
  refuses the DistTensor, naming the operation).

Neither is a layout that trains, and neither says why.  Fix: at ``Trainer.__init__``, on a
CPU device, this combination is refused with :class:`AutoParallelLayoutError` naming the flags
and what trains instead (the same flags without ``--enable_auto_parallel``: fleet's TP, verified
equal to one process here).  On an accelerator nothing changes (the device rule: not run there).
"""
from __future__ import annotations

from .cpu_precision import on_cpu

__all__ = ["AutoParallelLayoutError", "check"]


class AutoParallelLayoutError(ValueError):
    """An auto-parallel Trainer layout that cannot train on this device."""


def check(args) -> None:
    """Raise :class:`AutoParallelLayoutError` for auto-parallel tensor parallelism without the
    intermediate API, on a CPU device."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if not getattr(args, "enable_auto_parallel", False) or tp <= 1 or getattr(args, "use_intermediate_api", False):
        return
    if on_cpu(args):
        raise AutoParallelLayoutError(
            f"--enable_auto_parallel 1 with --tensor_model_parallel_size {tp} on a CPU device: PaddleFormers 1.2 "
            "builds fleet's tensor-parallel layers and hands them auto-parallel DistTensors; Paddle's fused FSDP "
            "then all-gathers over a one-rank data-parallel group that has no process group, and the first "
            "tensor-parallel all-reduce is handed a DistTensor (stock: a segmentation fault). Drop "
            "--enable_auto_parallel (fleet's tensor parallelism trains this layout equal to one process), or keep "
            "--enable_auto_parallel for data parallelism and sharding only. (paddle_hybrid.paddleformers_fixes)")
