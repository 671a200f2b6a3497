"""Fleet glue of the pipeline send-wait rewrite (static pipeline parallel).

``PipelineSendWaitOptimizer`` wraps fleet's ``PipelineOptimizer`` (it lists it,
and what it wraps, in its white list, so fleet applies it outermost), lets it build the
section program, then applies
:class:`~.rewrite.SendWaitPass` (:func:`~.rewrite.apply_pipeline_send_wait`) to it.
It applies when ``strategy.pipeline`` is set (without sharding) and the role is collective; fleet
knows it while the ``send_wait`` component is installed (``PluginConfig.send_wait``).
"""
from __future__ import annotations

from paddle.distributed.fleet.meta_optimizers.meta_optimizer_base import MetaOptimizerBase

from .rewrite import PASS_NAME, SendWaitPass

__all__ = ["PipelineSendWaitOptimizer"]


class PipelineSendWaitOptimizer(MetaOptimizerBase):
    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.inner_opt = optimizer
        # Fleet chains A -> B -> C only if A also lists C: list what PipelineOptimizer wraps.
        self.meta_optimizers_white_list = ["PipelineOptimizer", "RecomputeOptimizer", "AMPOptimizer"]
        self.meta_optimizers_black_list = []
        self.last_result = None
        """The :class:`~.rewrite.SendWaitResult` of the last minimize."""

    def _can_apply(self):
        if not self.role_maker._is_collective:
            return False
        strategy = self.user_defined_strategy
        return bool(strategy.pipeline) and not strategy.sharding

    def _disable_strategy(self, dist_strategy):
        # The rewrite has no strategy flag of its own (DistributedStrategy rejects
        # new attributes); it follows strategy.pipeline, which fleet's
        # PipelineOptimizer owns.
        pass

    def _enable_strategy(self, dist_strategy, context):
        pass

    def minimize_impl(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        result = self.inner_opt.minimize(loss, startup_program, parameter_list, no_grad_set)
        pipeline_opt = getattr(loss.block.program, "_pipeline_opt", None) or {}
        section = pipeline_opt.get("section_program")
        if section is None:
            raise RuntimeError(
                "PipelineSendWaitOptimizer: fleet's PipelineOptimizer produced no section program "
                "(program._pipeline_opt['section_program']); set PADDLE_HYBRID_SEND_WAIT=0 to "
                "train without the send-wait rewrite.")
        context = SendWaitPass().apply([section], [None])
        self.last_result = context.get_attr(PASS_NAME)
        return result
