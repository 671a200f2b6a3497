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

Three patches, undone by ``paddle_hybrid.uninstall()`` (which first detaches every bucket
set's hooks and gives DataParallel models their reducer back): ``fleet.distributed_model`` (attach),
``HybridParallelOptimizer._hybrid_sync_grad`` (``finish_grad_sync`` of the
buckets, Paddle's sync for any other parameter) and ``Tensor.clear_gradient``
(in-place zero for bucketed parameters, so their gradients stay views).
"""
from __future__ import annotations

import functools

from . import grad_buckets
from .grad_buckets import BucketLayoutError, GradBuckets, GradSyncError, buckets_of

__all__ = ["skip_reason", "apply", "VERIFIED_PADDLE", "SWITCH", "GradBuckets", "BucketLayoutError", "GradSyncError", "buckets_of",
           "attach_buckets"]



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


def _make_distributed_model(orig, config):
    @functools.wraps(orig)
    def distributed_model(model):
        from paddle.distributed import fleet

        out = orig(model)
        attach_buckets(out, fleet.fleet._user_defined_strategy, fleet.fleet._hcg,
                       max_params=config.grad_bucket_max_params)
        return out

    return distributed_model


def _make_hybrid_sync_grad(orig, config):
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


def _make_clear_gradient(orig, config):
    def clear_gradient(self, set_to_zero=True):
        if grad_buckets.is_bucketed(self):
            self._zero_grads()  # keep the view into the bucket buffer
            return None
        return orig(self, set_to_zero)

    clear_gradient.__doc__ = orig.__doc__
    return clear_gradient


VERIFIED_PADDLE = ("3.3.",)
SWITCH = "PADDLE_HYBRID_GRAD_BUCKETS=0 (PluginConfig(grad_buckets=False))"


def skip_reason(config):
    return None if config.grad_buckets else "switched off (grad_buckets=False)"


def apply(config, patcher) -> None:
    """Phases: check every target exists (before any change), patch, and on undo detach every
    bucket set's hooks before the originals come back."""
    import paddle
    from paddle.distributed import fleet

    hpo = _hpo_class()
    targets = {(fleet, "distributed_model"): _make_distributed_model,
               (hpo, "_hybrid_sync_grad"): _make_hybrid_sync_grad,
               (paddle.Tensor, "clear_gradient"): _make_clear_gradient}
    for owner, name in targets:
        if not callable(patcher.require(owner, name, getattr(owner, "__name__", str(owner)))):
            raise RuntimeError(f"paddle_hybrid.dygraph: {owner.__name__}.{name} is not callable; unexpected Paddle.")
    for (owner, name), make in targets.items():
        patcher.set(owner, name, make(getattr(owner, name), config))
    patcher.on_revert(_remove_all_buckets, "detach every gradient bucket set")


def _remove_all_buckets() -> None:
    for s in grad_buckets.all_bucket_sets():
        s.remove()
