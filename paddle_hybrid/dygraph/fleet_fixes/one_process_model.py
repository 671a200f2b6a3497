"""``fleet.distributed_model(layer)`` in one process returns the layer.

With one process (``get_world_size() <= 1``) Paddle 3.2 and 3.3 wrap any model in
``NoPipelineParallel``, whose ``__init__`` asserts a ``PipelineLayer``
(``pipeline_parallel.py``: ``assert isinstance(layers, PipelineLayer)``): a fleet script whose model
is a plain layer (tensor or data parallel in the job it was written for) cannot run in one
process, on any device, so the one-process run that a layout is compared with cannot be made.

Patch: in one process, a model that is not a ``PipelineLayer`` is returned as it is (what the
wrappers of a multi-process run add to a plain layer, a reducer or a tensor-parallel
broadcast, has nothing to do with one rank); a ``PipelineLayer`` still gets Paddle's
``NoPipelineParallel``.
"""
from __future__ import annotations

import functools

__all__ = ["apply"]


def _make(original):
    @functools.wraps(original)
    def distributed_model(model, *args, **kwargs):
        import paddle.distributed as dist
        from paddle.distributed.fleet.meta_parallel import PipelineLayer

        if dist.get_world_size() <= 1 and not isinstance(model, PipelineLayer):
            return model
        return original(model, *args, **kwargs)

    return distributed_model


def apply(config, patcher) -> None:
    from paddle.distributed import fleet
    from paddle.distributed.fleet import model as fleet_model

    original = patcher.require(fleet_model, "distributed_model", "paddle.distributed.fleet.model")
    replacement = _make(original)
    patcher.set(fleet_model, "distributed_model", replacement)
    if getattr(fleet, "distributed_model", None) is original:
        patcher.set(fleet, "distributed_model", replacement)
