"""A ``dist.to_static`` pipeline whose ``strategy.pipeline.pp_degree`` is left at 1 waits forever.

Paddle 3.2.2 and 3.3.1: the PIR pipeline pass (``auto_parallel/static/pir_pass.py``,
``pipeline_pass``) derives each rank's stage from ``strategy.pipeline.pp_degree``
(``rank // (world_size // pp_degree)``), not from the meshes the model was placed on.  Left at its
default 1, every rank takes stage 0 of 1: the job lists of a one-stage schedule, while the
program sends and receives between stages.  With 1F1B each rank then receives before it sends and
the ranks wait for each other until a timeout, on every device (on CPU: 600 s, then a gloo
timeout naming a receive).

Fix: the pass is refused at once when ``pp_degree`` is 1 and the program exchanges tensors between
stages (``send_v2`` / ``recv_v2``), with :class:`PipelineDegreeError` naming the setting.
"""
from __future__ import annotations

import functools

__all__ = ["PipelineDegreeError", "apply"]

_P2P_OPS = ("pd_op.send_v2", "pd_op.recv_v2")


class PipelineDegreeError(ValueError):
    """``strategy.pipeline.pp_degree`` does not describe the pipeline the program holds."""


def _exchanges_between_stages(programs) -> bool:
    for program in programs if isinstance(programs, (list, tuple)) else [programs]:
        if any(op.name() in _P2P_OPS for op in program.global_block().ops):
            return True
    return False


def _make_pipeline_pass(original):
    @functools.wraps(original)
    def pipeline_pass(dense_main_program, dense_startup_program, pipeline_strategy):
        if int(pipeline_strategy.pp_degree) <= 1 and _exchanges_between_stages(dense_main_program):
            raise PipelineDegreeError(
                f"paddle_hybrid.fleet_fixes: strategy.pipeline is enabled (schedule_mode "
                f"{pipeline_strategy.schedule_mode!r}) and the program sends tensors between pipeline stages, but "
                f"strategy.pipeline.pp_degree is {pipeline_strategy.pp_degree}. Paddle derives each rank's stage "
                "from pp_degree; left at 1 every rank takes the schedule of a one-stage pipeline and the ranks "
                "wait for each other until a timeout. Set strategy.pipeline.pp_degree to the number of stages "
                "(the process meshes the layers are placed on).")
        return original(dense_main_program, dense_startup_program, pipeline_strategy)

    return pipeline_pass


def apply(config, patcher) -> None:
    from paddle.distributed.auto_parallel.static import engine

    original = patcher.require(engine, "pipeline_pass", "paddle.distributed.auto_parallel.static.engine")
    patcher.check_params(original, ["dense_main_program", "dense_startup_program", "pipeline_strategy"],
                         "pipeline_pass")
    patcher.set(engine, "pipeline_pass", _make_pipeline_pass(original))
