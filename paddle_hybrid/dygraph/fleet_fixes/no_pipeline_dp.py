"""A one-stage ``PipelineLayer`` under pure data parallelism gets its gradients averaged.

``fleet.distributed_model`` wraps a ``PipelineLayer`` with ``pp_degree == 1`` in
``NoPipelineParallel`` (no ``paddle.DataParallel``, so no reducer), and leaves the data-
parallel gradient sync to ``HybridParallelOptimizer``.  But with only ``dp_degree > 1``
fleet's parallel mode is ``DATA_PARALLEL``, where the optimizer assumes a reducer did the
sync (``_dp_enable = not _use_dp_mode and _need_dp`` is False).  Nobody all-reduces: every
rank steps with its own local gradient, the replicas drift apart and the loss differs from
a single-process run from step 2 on, with no error (seen with examples/gpt_pp.py
``--pp 1 --dp 2``; on any device).

Patch: ``NoPipelineParallel.__init__`` marks the model's parameters when the mode is
``DATA_PARALLEL`` with ``dp_degree > 1``; ``HybridParallelOptimizer._hybrid_sync_grad``
averages the marked parameters' gradients over the data-parallel group (Paddle's own
``fused_allreduce_gradients``) after its own sync, which does nothing for them in that mode.
"""
from __future__ import annotations

import functools

__all__ = ["apply", "MARK"]

MARK = "_ph_dp_sync_by_optimizer"


def _make_init(orig):
    @functools.wraps(orig)
    def __init__(self, layers, strategy, hcg=None):
        orig(self, layers, strategy, hcg)
        from paddle.distributed.fleet.base.topology import ParallelMode

        if (hcg is not None and hcg.get_parallel_mode() == ParallelMode.DATA_PARALLEL
                and hcg.get_data_parallel_world_size() > 1):
            for p in layers.parameters():
                setattr(p, MARK, True)

    return __init__


def _make_sync(orig):
    @functools.wraps(orig)
    def _hybrid_sync_grad(self, parameter_list):
        from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

        orig(self, parameter_list)
        if self._use_dp_mode and self._need_dp:  # the mode in which Paddle's own sync skips them
            marked = [p for p in parameter_list if getattr(p, MARK, False)]
            if marked:
                fused_allreduce_gradients(marked, self._hcg)

    return _hybrid_sync_grad


def apply(config, patcher) -> None:
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import hybrid_parallel_optimizer as hpo_mod
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel as pp

    if not hasattr(pp, "NoPipelineParallel"):
        # Paddle < 3.3 (checked: 3.2.2) has no NoPipelineParallel: fleet.distributed_model wraps a
        # one-stage PipelineLayer under pure DP in paddle.DataParallel, whose reducer syncs.
        return
    npp = patcher.require(pp, "NoPipelineParallel", "meta_parallel.pipeline_parallel")
    hpo = patcher.require(hpo_mod, "HybridParallelOptimizer", "hybrid_parallel_optimizer")
    patcher.check_params(npp.__init__, ["self", "layers", "strategy", "hcg"], "NoPipelineParallel.__init__")
    patcher.check_params(hpo._hybrid_sync_grad, ["self", "parameter_list"], "HybridParallelOptimizer._hybrid_sync_grad")
    patcher.set(npp, "__init__", _make_init(npp.__init__))
    patcher.set(hpo, "_hybrid_sync_grad", _make_sync(hpo._hybrid_sync_grad))
