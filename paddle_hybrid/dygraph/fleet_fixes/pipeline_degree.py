"""A ``dist.to_static`` 1F1B or VPP pipeline whose ``strategy.pipeline.pp_degree`` is left at 1 waits forever.

Paddle 3.2.2 and 3.3.1: the PIR pipeline pass (``auto_parallel/static/pir_pass.py``,
``pipeline_pass``) derives each rank's stage from ``strategy.pipeline.pp_degree``
(``rank // (world_size // pp_degree)``), not from the meshes the model was placed on.  Left at its
default 1, every rank takes stage 0 of 1.  FThenB's job list does not depend on the stage (all
forwards, then all backwards), so it trains right.  1F1B's and VPP's do: with two stages and two
microbatches every rank runs ``F0, B0, recv F1, send B0, F1, B1``, so the last stage waits for
microbatch 1's activations before it sends microbatch 0's gradient, and the first stage waits for
that gradient before it sends those activations.  The order alone deadlocks, on every device and
transport (on CPU: the deadline, then a gloo timeout naming a receive).

Fix: a 1F1B or VPP pass is refused at once when ``pp_degree`` is 1 and the program exchanges
tensors between stages (``send_v2`` / ``recv_v2``), with :class:`PipelineDegreeError` naming the
setting; FThenB goes to Paddle unchanged.
"""
from __future__ import annotations

import functools

__all__ = ["PipelineDegreeError", "apply"]

_P2P_OPS = ("pd_op.send_v2", "pd_op.recv_v2")
# Schedules whose job lists depend on the rank's stage (FThenB's does not).
_STAGE_ORDERED_SCHEDULES = ("1F1B", "VPP")


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
        if (pipeline_strategy.schedule_mode in _STAGE_ORDERED_SCHEDULES and int(pipeline_strategy.pp_degree) <= 1
                and _exchanges_between_stages(dense_main_program)):
            raise PipelineDegreeError(
                f"paddle_hybrid.fleet_fixes: strategy.pipeline is enabled (schedule_mode "
                f"{pipeline_strategy.schedule_mode!r}) and the program sends tensors between pipeline stages, but "
                f"strategy.pipeline.pp_degree is {pipeline_strategy.pp_degree}. Paddle derives each rank's stage "
                "from pp_degree; left at 1 every rank takes the job order of the first stage, and in this schedule "
                "the last stage then waits for the next microbatch before it sends the gradient the first stage "
                "waits for: the ranks wait for each other until a timeout, on any device. Set "
                "strategy.pipeline.pp_degree to the number of stages (the process meshes the layers are placed on).")
        return original(dense_main_program, dense_startup_program, pipeline_strategy)

    return pipeline_pass


def apply(config, patcher) -> None:
    from paddle.distributed.auto_parallel.static import engine

    original = patcher.require(engine, "pipeline_pass", "paddle.distributed.auto_parallel.static.engine")
    patcher.check_params(original, ["dense_main_program", "dense_startup_program", "pipeline_strategy"],
                         "pipeline_pass")
    patcher.set(engine, "pipeline_pass", _make_pipeline_pass(original))
