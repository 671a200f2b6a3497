"""Dygraph gradient sync with persistent fused buckets (:mod:`.grad_buckets`), wired
into fleet.

With ``strategy.fuse_all_reduce_ops`` (fleet's default: True) and
``PluginConfig.grad_buckets`` (default True), ``fleet.distributed_model`` attaches
:class:`~.grad_buckets.GradBuckets` to

* a pipeline model (``PipelineParallel`` and its interleaved subclasses) with a
  data-parallel degree > 1: buckets over the stage's DP group, one all_reduce per
  bucket per ``train_batch`` (``accumulate_steps`` microbatches);
* a plain data-parallel model (``paddle.DataParallel``): its reducer is switched
  off (``grad_need_sync = False``) and the buckets sync instead; the model's
  ``no_sync()`` pauses them, for gradient accumulation.

Bucket size: ``strategy.fuse_grad_size_in_MB``; count limit:
``PluginConfig.grad_bucket_max_params``.  Not used (Paddle's path stays) with
tensor, sharding or sep parallelism, or ``pp_configs.dp_comm_overlap``.

Three patches, undone by :func:`uninstall`: ``fleet.distributed_model`` (attach),
``HybridParallelOptimizer._hybrid_sync_grad`` (``finish_grad_sync`` of the
buckets, Paddle's sync for any other parameter) and ``Tensor.clear_gradient``
(in-place zero for bucketed parameters, so their gradients stay views).
"""
from __future__ import annotations

import functools

from . import grad_buckets
from .grad_buckets import BucketLayoutError, GradBuckets, GradSyncError, buckets_of

__all__ = ["install", "uninstall", "GradBuckets", "BucketLayoutError", "GradSyncError", "buckets_of",
           "attach_buckets"]

_saved: list = []
_config = None


def _hpo_class():
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )

    return HybridParallelOptimizer


def _shared_weight_ids(pipeline_layer) -> set:
    """ids of the parameters a PipelineLayer shares between stages."""
    ids = set()
    for comm in getattr(pipeline_layer, "shared_comm", {}).values():
        for attr in comm["weight_attr"]:
            ids.add(id(getattr(comm["layer"], attr)))
    return ids


def attach_buckets(model, strategy, hcg, max_params: int = 0):
    """Attach gradient buckets to a model returned by ``fleet.distributed_model`` if the
    strategy and the topology call for them; returns the buckets or None."""
    import paddle
    from paddle.distributed.fleet.meta_parallel import PipelineParallel

    if strategy is None or hcg is None or not strategy.fuse_all_reduce_ops:
        return None
    if hcg.get_data_parallel_world_size() <= 1:
        return None
    if (hcg.get_model_parallel_world_size() > 1 or hcg.get_sharding_parallel_world_size() > 1
            or hcg.get_sep_parallel_world_size() > 1):
        return None
    size_mb = strategy.fuse_grad_size_in_MB
    group = hcg.get_data_parallel_group()
    if isinstance(model, PipelineParallel):
        if model._dp_comm_overlap or model._sharding_comm_overlap:
            return None
        # Weights shared between stages (SharedLayerDesc) are summed across the
        # stages after the pipeline schedule (allreduce_shared_weight_gradients);
        # reducing them over DP earlier, from backward hooks, would add one
        # stage's DP-averaged gradient to the other stage's local one.  They stay
        # on Paddle's own DP sync, which runs after that sum.
        shared = _shared_weight_ids(model._layers)
        params = [p for p in model._layers.parameters() if id(p) not in shared]
        if not params:
            return None
        buckets = GradBuckets(params, group=group, bucket_size_mb=size_mb,
                              max_params=max_params, accumulate_steps=model.accumulate_steps)
    elif isinstance(model, paddle.DataParallel):
        buckets = GradBuckets(model._layers.parameters(), group=group, bucket_size_mb=size_mb,
                              max_params=max_params, accumulate_steps=1)
        model.grad_need_sync = False  # the buckets replace the reducer
        model.no_sync = buckets.no_sync  # ``with model.no_sync():`` keeps working
    else:
        return None
    model._ph_grad_buckets = buckets
    return buckets


def _make_distributed_model(orig):
    @functools.wraps(orig)
    def distributed_model(model):
        from paddle.distributed import fleet

        out = orig(model)
        if _config is not None and _config.grad_buckets:
            attach_buckets(out, fleet.fleet._user_defined_strategy, fleet.fleet._hcg,
                           max_params=_config.grad_bucket_max_params)
        return out

    return distributed_model


def _make_hybrid_sync_grad(orig):
    @functools.wraps(orig)
    def _hybrid_sync_grad(self, parameter_list):
        sets, rest = grad_buckets.buckets_for_params(parameter_list)
        for s in sets:
            s.finish_grad_sync()
        if not sets:
            return orig(self, parameter_list)
        if rest:
            return orig(self, rest)
        return None

    return _hybrid_sync_grad


def _make_clear_gradient(orig):
    def clear_gradient(self, set_to_zero=True):
        if grad_buckets.is_bucketed(self):
            self._zero_grads()  # keep the view into the bucket buffer
            return None
        return orig(self, set_to_zero)

    clear_gradient.__doc__ = orig.__doc__
    return clear_gradient


def _set(owner, name, value):
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def install(config) -> None:
    global _config
    if _saved:
        return
    import paddle
    from paddle.distributed import fleet

    hpo = _hpo_class()
    for owner, name in ((fleet, "distributed_model"), (hpo, "_hybrid_sync_grad"), (paddle.Tensor, "clear_gradient")):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(f"paddle_hybrid.dygraph: {owner.__name__}.{name} not found; unexpected Paddle "
                               "version. Set PADDLE_HYBRID_GRAD_BUCKETS=0 to run without gradient buckets.")
    _config = config
    _set(fleet, "distributed_model", _make_distributed_model(fleet.distributed_model))
    _set(hpo, "_hybrid_sync_grad", _make_hybrid_sync_grad(hpo._hybrid_sync_grad))
    _set(paddle.Tensor, "clear_gradient", _make_clear_gradient(paddle.Tensor.clear_gradient))


def uninstall() -> None:
    global _config
    for s in grad_buckets.all_bucket_sets():
        s.remove()
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
    _config = None
