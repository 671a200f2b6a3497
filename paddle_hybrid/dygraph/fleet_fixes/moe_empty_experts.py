"""``MoELayer``: a rank whose experts get no token still takes part in backward.

``MoELayer.forward`` returns the scattered input unchanged when this rank's experts received no
rows (``experts_fwd``: ``if x.shape[0] == 0: return x``).  If the layer's input needs no
gradient (the first layer fed with data, or a frozen trunk), that tensor needs none either, so
autograd never calls ``MoEGather.backward`` on this rank, and the ``global_scatter`` in it, a
collective over the MoE group, is never posted.  The ranks whose experts did get tokens wait
in theirs until the job times out (any device).

Patch: ``MoEGather.apply`` with a MoE group of more than one rank, while gradients are
recorded, marks its input as needing a gradient (a detached alias, so nothing before it is
touched), so every rank of the group runs the backward collective.  A rank that did get tokens
is unchanged: its input already needs a gradient through the experts' weights.
"""
from __future__ import annotations

__all__ = ["apply"]


def _make_apply(original_apply):
    def apply(cls, global_output_buf, pos, local_expert_count, global_expert_count, local_batch_size,
              world_size, group=None):
        import paddle

        if world_size > 1 and paddle.is_grad_enabled() and global_output_buf.stop_gradient:
            global_output_buf = global_output_buf.detach()
            global_output_buf.stop_gradient = False
        return original_apply(global_output_buf, pos, local_expert_count, global_expert_count,
                              local_batch_size, world_size, group)

    return classmethod(apply)


def apply(config, patcher) -> None:
    import importlib

    moe_layer = importlib.import_module("paddle.incubate.distributed.models.moe.moe_layer")
    gather = patcher.require(moe_layer, "MoEGather", "moe_layer")
    patcher.check_params(gather.forward, ["ctx", "global_output_buf", "pos", "local_expert_count",
                                          "global_expert_count", "local_batch_size", "world_size", "group"],
                         "MoEGather.forward")
    patcher.set(gather, "apply", _make_apply(gather.apply))
