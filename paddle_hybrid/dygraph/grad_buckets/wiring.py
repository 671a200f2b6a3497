"""Fleet wiring of the gradient buckets, and the plugin component that installs it.

``fleet.distributed_model`` (patched) attaches a :class:`~.sync.GradBuckets` when
``strategy.fuse_all_reduce_ops`` is on and the layout calls for it:

* ``paddle.DataParallel``: the reducer is paused (``grad_need_sync = False``) and
  ``model.no_sync`` becomes the buckets' ``no_sync``; the sync finishes at the end of every
  backward pass outside ``no_sync()``.
* ``PipelineParallel`` (and its interleaved subclasses), over the stage's data-parallel group:
  ``model._backward_step`` marks the last microbatch of each model chunk, and
  ``model.forward_backward_pipeline`` finishes the sync when the schedule is over, before
  ``_optimizer_step`` (``delay_scale_loss``'s division, the scaler's unscale, the optimizer)
  reads a gradient.  Weights shared between stages stay on Paddle's sync, which runs after
  the cross-stage sum.

Both are instance attributes, undone by ``GradBuckets.remove()``.  Not attached (Paddle's
path stays) with tensor, sharding or sep parallelism, ``pp_configs.dp_comm_overlap``, or
parameters only some of which use fleet's ``main_grad``.

Patches (all undone by ``paddle_hybrid.uninstall()``, after every bucket set is removed):
``fleet.distributed_model`` (attach), ``HybridParallelOptimizer._hybrid_sync_grad`` (finish the
buckets, Paddle's sync for everything else), ``Tensor.clear_gradient`` (bucketed gradients:
``set_to_zero=True`` zeroes in place, so they stay aliases of the buffers; ``False`` drops them,
``.grad`` is None, and the next backward re-binds the views), ``Tensor.backward`` and
``paddle.autograd.backward`` (the end of a backward pass, :mod:`.backward_end`).
"""
from __future__ import annotations

import functools
import warnings

from ...common import grad_tools
from ...common.pipeline_chunk import backward_chunk, takes_chunk_id
from . import backward_end
from .sync import GradBuckets, all_bucket_sets, buckets_for_params, is_bucketed

__all__ = ["attach_buckets", "buckets_of", "apply"]

ATTR = "_ph_grad_buckets"


def buckets_of(model):
    """The :class:`GradBuckets` that ``fleet.distributed_model`` attached to ``model``, or None."""
    return getattr(model, ATTR, None)


# -- attaching -----------------------------------------------------------------------------

def _wanted(model, strategy, hcg) -> bool:
    from paddle.distributed.fleet.meta_parallel import PipelineParallel

    if strategy is None or hcg is None or not strategy.fuse_all_reduce_ops:
        return False
    if hcg.get_data_parallel_world_size() <= 1:
        return False
    if (hcg.get_model_parallel_world_size() > 1 or hcg.get_sharding_parallel_world_size() > 1
            or hcg.get_sep_parallel_world_size() > 1):
        return False
    if isinstance(model, PipelineParallel):
        return not (model._dp_comm_overlap or model._sharding_comm_overlap)
    import paddle

    return isinstance(model, paddle.DataParallel)


def _bucket_params(model) -> list:
    """The parameters the buckets take.  In a pipeline, weights shared between stages
    (SharedLayerDesc) are summed across the stages after the schedule
    (``allreduce_shared_weight_gradients``); reducing them over DP earlier would add one
    stage's DP-averaged gradient to the other stage's local one, so they stay on Paddle's
    sync, which runs after that sum."""
    from paddle.distributed.fleet.meta_parallel import PipelineParallel

    params = list(model._layers.parameters())
    if not isinstance(model, PipelineParallel):
        return params
    shared = set()
    for comm in getattr(model._layers, "shared_comm", {}).values():
        shared.update(id(getattr(comm["layer"], attr)) for attr in comm["weight_attr"])
    return [p for p in params if id(p) not in shared]


def attach_buckets(model, strategy, hcg, max_params: int = 0, layout_timeout: float | None = None):
    """Attach gradient buckets to a model returned by ``fleet.distributed_model`` if the
    strategy and the topology call for them; returns the buckets or None."""
    from paddle.distributed.fleet.meta_parallel import PipelineParallel

    if not _wanted(model, strategy, hcg):
        return None
    # a no_sync parameter (an expert of this rank's own) is not averaged by paddle.DataParallel either
    params = [p for p in _bucket_params(model) if not p.stop_gradient and not getattr(p, "no_sync", False)]
    if not params:
        return None
    with_main_grad = [hasattr(p, "main_grad") for p in params]
    if any(with_main_grad) and not all(with_main_grad):
        warnings.warn("paddle_hybrid: gradient buckets step aside: only some parameters use main_grad "
                      "(MixPrecisionLayer); Paddle's gradient sync stays.", RuntimeWarning, stacklevel=3)
        return None
    pipeline = isinstance(model, PipelineParallel)
    timeout = {} if layout_timeout is None else {"layout_timeout": layout_timeout}
    buckets = GradBuckets(params, group=hcg.get_data_parallel_group(), bucket_size_mb=strategy.fuse_grad_size_in_MB,
                          max_params=max_params, finish_at_backward_end=not pipeline, **timeout)
    (_wire_pipeline if pipeline else _wire_data_parallel)(model, buckets)
    setattr(model, ATTR, buckets)
    buckets.on_remove(lambda: _del_attr(model, ATTR))
    return buckets


def _del_attr(obj, name) -> None:
    if name in vars(obj):
        delattr(obj, name)


def _wire_data_parallel(model, buckets) -> None:
    """The buckets replace the reducer; ``with model.no_sync():`` keeps working."""
    saved_sync, saved_no_sync = model.grad_need_sync, vars(model).get("no_sync")
    model.grad_need_sync = False
    model.no_sync = buckets.no_sync

    def undo():
        model.grad_need_sync = saved_sync
        _del_attr(model, "no_sync")
        if saved_no_sync is not None:
            model.no_sync = saved_no_sync

    buckets.on_remove(undo)


def _wire_pipeline(model, buckets) -> None:
    """Mark each chunk's last microbatch; finish the sync after the schedule."""
    buckets.is_last_microbatch = False
    seen: dict = {}  # model chunk -> backward steps run in this schedule
    with_chunk_id = takes_chunk_id(type(model)._backward_step)

    def _backward_step(*args, **kwargs):
        chunk = backward_chunk(model, args, kwargs, with_chunk_id)
        seen[chunk] = seen.get(chunk, 0) + 1
        buckets.is_last_microbatch = seen[chunk] == model.accumulate_steps
        try:
            # looked up now: a class-level wrapper installed later (the timeline) still runs
            out = type(model)._backward_step(model, *args, **kwargs)
            if not backward_end.in_backward():
                backward_end.end_pass()  # a no-op when the wrapped paddle.autograd.backward ended it
            return out
        finally:
            buckets.is_last_microbatch = False

    def forward_backward_pipeline(*args, **kwargs):
        seen.clear()
        out = type(model).forward_backward_pipeline(model, *args, **kwargs)
        buckets.finish_grad_sync()  # before _optimizer_step: every reader sees the average
        return out

    model._backward_step = _backward_step
    model.forward_backward_pipeline = forward_backward_pipeline

    def undo():
        _del_attr(model, "_backward_step")
        _del_attr(model, "forward_backward_pipeline")

    buckets.on_remove(undo)


# -- patches ---------------------------------------------------------------------------------

def _make_distributed_model(orig, config):
    @functools.wraps(orig)
    def distributed_model(model):
        from paddle.distributed import fleet

        out = orig(model)
        attach_buckets(out, fleet.fleet._user_defined_strategy, fleet.fleet._hcg,
                       max_params=config.grad_bucket_max_params, layout_timeout=config.timeout)
        return out

    return distributed_model


def _make_hybrid_sync_grad(orig, config):
    @functools.wraps(orig)
    def _hybrid_sync_grad(self, parameter_list):
        sets, rest = buckets_for_params(parameter_list)
        for s in sets:
            s.finish_grad_sync()  # normally done already (end of backward / schedule): a no-op
        if not sets:
            return orig(self, parameter_list)
        if rest:
            return orig(self, rest)
        return None

    return _hybrid_sync_grad


def _make_clear_gradient(orig, config):
    def clear_gradient(self, set_to_zero=True):
        # set_to_zero=True: Paddle's clear would mark the alias "fake empty" (the next backward
        # then assigns a fresh tensor): a bucketed gradient is zeroed in place instead.
        # set_to_zero=False: Paddle's promise holds (.grad is None, as torch's set_to_none); the
        # buckets re-bind the view on the next backward (GradBuckets.release_grads).
        if is_bucketed(self) and not hasattr(self, "main_grad"):
            if set_to_zero:
                grad_tools.zero_grad_in_place(self)
                return None
            out = orig(self, False)
            buckets_for_params([self])[0][0].release_grads([self])
            return out
        return orig(self, set_to_zero)

    clear_gradient.__doc__ = orig.__doc__
    return clear_gradient


def apply(config, patcher) -> None:
    """Phases: check every target exists (before any change), patch, and on undo remove
    every bucket set (hooks, model wiring) before the originals come back."""
    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )

    patcher.check_params(HybridParallelOptimizer._hybrid_sync_grad, ["self", "parameter_list"],
                         "HybridParallelOptimizer._hybrid_sync_grad")
    targets = {(fleet, "distributed_model"): _make_distributed_model,
               (HybridParallelOptimizer, "_hybrid_sync_grad"): _make_hybrid_sync_grad,
               (paddle.Tensor, "clear_gradient"): _make_clear_gradient,
               (paddle.Tensor, "backward"): lambda orig, _: backward_end.wrap_backward(orig),
               (paddle.autograd, "backward"): lambda orig, _: backward_end.wrap_backward(orig)}
    for owner, name in targets:
        if not callable(patcher.require(owner, name, getattr(owner, "__name__", str(owner)))):
            raise RuntimeError(f"paddle_hybrid.dygraph.grad_buckets: {owner.__name__}.{name} is not callable; "
                               "unexpected Paddle.")
    for (owner, name), make in targets.items():
        patcher.set(owner, name, make(getattr(owner, name), config))
    patcher.on_revert(_remove_all_buckets, "remove every gradient bucket set")


def _remove_all_buckets() -> None:
    for s in all_bucket_sets():
        s.remove()
