"""Fleet glue of the fused all-reduce rewrite (static data parallel).

``FusedAllreduceOptimizer`` maps the strategy onto
:class:`~.plan.FuseAllreduceConfig` and applies the pass
(:class:`~.rewrite.FuseAllreducePass`); it does nothing else.  It applies to collective, legacy-IR static
programs on more than one rank when:

* ``strategy.fuse_all_reduce_ops`` is True (Paddle's default), or
* the place is CPU: Paddle's own ``RawProgramOptimizer`` cannot run there
  ("comm_id must be generated"), so the plugin also owns the unfused
  (one ``all_reduce`` per gradient) path on CPU.

Limits: ``strategy.fuse_grad_size_in_MB`` (bytes) and
``strategy.fuse_grad_size_in_num`` (count); a group closes at whichever is
reached first.  Paddle's ``_enable_env`` copies ``fuse_grad_size_in_MB`` into
``FLAGS_fuse_parameter_memory_size`` (the same number) and maps
``fuse_grad_size_in_TFLOPS`` -- not a count -- to
``FLAGS_fuse_parameter_groups_size``, so the strategy fields are the source.

Fleet applies meta optimizers as a chain; this one lists
``RawProgramOptimizer`` in its white list so that, when both apply, it wraps
it and takes its place (it calls Raw's inner optimizer directly).

After ``minimize``, run the program with :class:`~.runner.StaticRunner`
(CPU: through PIR over gloo; GPU: the ordinary executor).
"""
from __future__ import annotations

import dataclasses

import paddle
from paddle.base import framework
from paddle.distributed.fleet.meta_optimizers.meta_optimizer_base import MetaOptimizerBase

from .plan import FuseAllreduceConfig
from .rewrite import DP_RING_ID, FuseAllreducePass
from .runner import use_pir_path

__all__ = ["FusedAllreduceOptimizer", "config_from_strategy", "for_config"]


def config_from_strategy(strategy, nranks: int) -> FuseAllreduceConfig:
    """The pass config for a fleet ``DistributedStrategy`` on ``nranks`` ranks."""
    return FuseAllreduceConfig(
        nranks=nranks,
        max_group_mb=float(strategy.fuse_grad_size_in_MB),
        max_group_count=int(strategy.fuse_grad_size_in_num),
        fuse=bool(strategy.fuse_all_reduce_ops),
    )


class FusedAllreduceOptimizer(MetaOptimizerBase):
    config = None
    """The plugin config of the component that made this class known to fleet (set on the class
    it registers, :func:`for_config`); without one the optimizer never applies."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.inner_opt = optimizer
        self.meta_optimizers_white_list = ["RawProgramOptimizer"]
        self.meta_optimizers_black_list = []

    def _nranks(self) -> int:
        return int(self.role_maker._worker_num())

    def _can_apply(self):
        if self.config is None:
            return False
        s = self.user_defined_strategy
        if not self.role_maker._is_collective or self._nranks() <= 1:
            return False
        if s.tensor_parallel or s.sharding or s.pipeline or s.semi_auto or s.auto_search:
            return False
        if s.gradient_merge or s.dgc or s.localsgd or s.adaptive_localsgd:
            return False
        if not isinstance(self.loss, framework.Variable):  # PIR value or dygraph tensor
            return False
        return bool(s.fuse_all_reduce_ops) or use_pir_path()

    def _disable_strategy(self, dist_strategy):
        # fuse_all_reduce_ops is Paddle's own flag (RawProgramOptimizer and the
        # graph passes read it too); leaving it untouched when this optimizer
        # does not apply keeps Paddle's behaviour exactly as without the plugin.
        return None

    def _enable_strategy(self, dist_strategy, context):
        dist_strategy.fuse_all_reduce_ops = True

    def _init_nccl(self, startup_program, ring_id: int) -> None:
        """GPU only (written after RawProgramOptimizer._init_process_group; not executed here)."""
        from paddle.distributed.fleet.meta_optimizers.common import CollectiveHelper

        endpoints = self.role_maker._get_trainer_endpoints()
        rank = self.role_maker._worker_index()
        helper = CollectiveHelper(self.role_maker, wait_port=False)
        helper._init_communicator(startup_program, endpoints[rank], endpoints, rank, ring_id, True, ring_id, True)

    def minimize_impl(self, loss, startup_program=None, parameter_list=None, no_grad_set=None):
        if not isinstance(loss, framework.Variable):
            raise TypeError(
                "FusedAllreduceOptimizer: the loss is not a legacy static Variable; build the "
                "program under paddle.pir_utils.OldIrGuard() (or FLAGS_enable_pir_api=0)."
            )
        if startup_program is None:
            startup_program = paddle.static.default_startup_program()
        inner = self.inner_opt
        if type(inner).__name__ == "RawProgramOptimizer":
            inner = inner.inner_opt  # this optimizer replaces Raw's all-reduce transpilation
        optimize_ops, params_grads = inner.minimize(loss, startup_program, parameter_list, no_grad_set)
        main = loss.block.program
        config = config_from_strategy(self.user_defined_strategy, self._nranks())
        if not use_pir_path():
            self._init_nccl(startup_program, DP_RING_ID)  # before the pass's broadcasts
        fuse_pass = FuseAllreducePass()
        for key, value in dataclasses.asdict(config).items():
            fuse_pass.set_attr(key, value)
        fuse_pass.set_attr("params_grads", params_grads)
        fuse_pass.apply([main], [startup_program])
        # What StaticRunner's layout check waits, unless its caller says otherwise.
        main._ph_layout_check_deadline = (self.config.seconds("static_layout_check_timeout"),
                                          self.config.deadline_setting("static_layout_check_timeout"))
        # Paddle's build-strategy graph passes do not know the plugin's ops.
        main._pass_applied = True
        return optimize_ops, params_grads


def for_config(config) -> type:
    """The class fleet is given: :class:`FusedAllreduceOptimizer` carrying ``config`` (fleet
    knows a meta optimizer by its class name, so the name stays)."""
    return type(FusedAllreduceOptimizer.__name__, (FusedAllreduceOptimizer,),
                {"config": config, "__module__": __name__, "__qualname__": FusedAllreduceOptimizer.__qualname__})
