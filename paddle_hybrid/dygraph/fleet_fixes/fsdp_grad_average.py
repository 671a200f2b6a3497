"""``fsdp.fully_shard`` in auto-parallel mode sums the data-parallel ranks' gradients instead of
averaging them, and with gradient accumulation loses micro-batches.

Paddle 3.3.1 (3.2.2 has no such class): ``FullyShardFusion`` (``auto_parallel/fully_shard_fusion.py``, what
``paddle.distributed.fsdp.fully_shard`` builds in auto-parallel mode, and what PaddleFormers'
``--enable_auto_parallel`` Trainer wraps every model in) reduce-scatters each rank's gradients
over the FSDP group with ``ReduceOp.SUM`` and hands the sums to the optimizer.  Each rank's
loss is the mean over its own part of the batch, so the optimizer gets n times the gradient of
the global mean on n ranks, on every device.  AdamW hides most of it (it divides by the
gradients' scale, but for its epsilon); clipping and every other optimizer do not.  Tiny LLaMA,
DP2, ``adam_epsilon`` 1.0: step 2 loss 4.278 where one process gives 4.394.

Second: with communication overlap (the default), a group's reduce-scatter result waits in its
temporary buffer until two later groups finished theirs.  A model of few groups accumulating
gradients starts the next micro-batch's backward while it waits: the group's gradients are
copied into the same temporary buffer, over the waiting result, and the queue later adds the
newest result twice.  One micro-batch is lost, another counted twice, on every device (the tiny
LLaMA, two micro-batches: no scale of the gradient gives one process's step).

Fixes: when the optimizer collects the fused gradients (``comm_sync_and_reset_status``, once per
step), each trainable group's gradient buffer is first divided by the FSDP group's size, after
its pending reduce-scatters completed: the mean over the ranks, as data parallelism gives.  And
when a gradient buffer's temporary buffer is asked for again while its reduce-scatter still
waits in the queue, that result is added to the group's gradients and the entry leaves the queue
first (what the queue would have done, before the buffer is reused).
"""
from __future__ import annotations

import functools

from ...common.grad_tools import divide_fused_fsdp_grads

__all__ = ["apply"]


def _make_sync(original):
    @functools.wraps(original)
    def comm_sync_and_reset_status(self):
        nranks = self.comm_manager.buffer_manager._fsdp_group.nranks
        if nranks > 1:
            divide_fused_fsdp_grads(self, nranks)
        return original(self)

    return comm_sync_and_reset_status


def _complete_waiting_reduce(buffer) -> None:
    """``buffer``'s reduce-scatter waiting in the queue: wait, add its result, leave the queue."""
    from paddle.distributed.auto_parallel.fully_shard_fusion import get_fsdp_context

    fsdp = get_fsdp_context()
    if fsdp is None:
        return
    queue = fsdp.comm_manager.grad_reduce_queue
    for index, entry in enumerate(queue):
        if entry is buffer:
            del queue[index]
            buffer.comm_task.wait()
            buffer.comm_task = None
            buffer.data_buffer.add_(buffer.tmp_data_buffer._slice(0, buffer.data_buffer.shape[0]))
            buffer.clear_tmp_buffer()
            return


def _make_get_tmp_buffer(original):
    @functools.wraps(original)
    def get_tmp_buffer(self):
        if self.comm_task is not None:  # a parameter buffer's all-gather never waits in the grad queue
            _complete_waiting_reduce(self)
        return original(self)

    return get_tmp_buffer


def apply(config, patcher) -> None:
    try:
        from paddle.distributed.auto_parallel.fully_shard_fusion import FullyShardFusion
    except ImportError:  # Paddle 3.2 has no fused FSDP: nothing to fix
        return

    original = patcher.require(FullyShardFusion, "comm_sync_and_reset_status",
                               "paddle.distributed.auto_parallel.fully_shard_fusion.FullyShardFusion")
    patcher.check_params(original, ["self"], "FullyShardFusion.comm_sync_and_reset_status")
    patcher.set(FullyShardFusion, "comm_sync_and_reset_status", _make_sync(original))
    from paddle.distributed.auto_parallel.fully_shard_fusion import TensorFusionBuffer

    get_tmp = patcher.require(TensorFusionBuffer, "get_tmp_buffer", "fully_shard_fusion.TensorFusionBuffer")
    patcher.check_params(get_tmp, ["self"], "TensorFusionBuffer.get_tmp_buffer")
    patcher.set(TensorFusionBuffer, "get_tmp_buffer", _make_get_tmp_buffer(get_tmp))
