"""``fsdp.fully_shard`` in auto-parallel mode stops on a parameter two layers share (tied embeddings).

Paddle 3.3.1 (3.2.2 has no such class): ``FullyShardFusion._shard_all_params`` makes every
parameter a replicated DistTensor layer by layer, with one ``dist.shard_tensor`` per layer that
holds it.  A parameter held by two layers (PaddleFormers' tied input embedding and output layer)
becomes two DistTensor parameters of one name over one storage.  The buffer manager puts both in
one fused group; moving the first into the buffer frees the storage and the second stops with
"DistTensor is not defined yet when `local_dims` method is called", on every device.  (Had it run,
two parameters would each get their own gradient and update: the tie broken.)  Paddle's fused FSDP
has a path for tied weights (``tie_param_name``, a group and a pre-forward hook of their own),
written for one parameter object held by both layers.

Fix: each parameter is converted once and the same DistTensor is set on every layer that holds it,
so the model's parameters hold it once and Paddle's tied-weight path gets what it expects.
"""
from __future__ import annotations

__all__ = ["apply"]


def _shard_all_params(self) -> None:
    import paddle.distributed as dist

    placements = [dist.Replicate() for _ in range(len(self.mesh.shape))]
    converted = {}  # id(dense parameter) -> (dense parameter kept alive, its DistTensor)
    for _, layer in self.model.named_sublayers(include_self=True):
        for name in list(layer._parameters.keys()):
            param = getattr(layer, name)
            if param is None or param.is_dist():
                continue
            if id(param) not in converted:
                converted[id(param)] = (param, dist.shard_tensor(param, self.mesh, placements))
            setattr(layer, name, converted[id(param)][1])


def apply(config, patcher) -> None:
    try:
        from paddle.distributed.auto_parallel.fully_shard_fusion import FullyShardFusion
    except ImportError:  # Paddle 3.2 has no fused FSDP: nothing to fix
        return
    original = patcher.require(FullyShardFusion, "_shard_all_params",
                               "paddle.distributed.auto_parallel.fully_shard_fusion.FullyShardFusion")
    patcher.check_params(original, ["self"], "FullyShardFusion._shard_all_params")
    patcher.set(FullyShardFusion, "_shard_all_params", _shard_all_params)
