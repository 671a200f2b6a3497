"""Which job runs when: the order of a stage's jobs in one step, and nothing else.

A step of a legacy section program runs, like Paddle's old section worker, the ``lr`` job once
(ops with the ``LRSched`` role: learning-rate schedule and the zeroing of the ``@MERGED``
gradient accumulators), the ``forward`` and ``backward`` jobs once per micro-batch in the
schedule's order, then the ``optimizer`` job once.  The order of the forwards and backwards is the
:class:`~paddle_hybrid.common.schedule.Action` list of :mod:`paddle_hybrid.common.schedule`; this
module only names each action's job (:data:`JOB_TYPES`).
"""
from __future__ import annotations

from ...common import schedule as schedule_orders
from ...common.schedule import Kind

__all__ = ["SCHEDULES", "JOB_TYPES", "job_order", "LR", "FORWARD", "BACKWARD", "OPTIMIZER"]

# Job types.  Not Paddle's "forward"/"backward": its standalone executor demands a statically
# built interpreter for a job named "backward" (auto-parallel's rule), and the p2p ``py_func``
# ops of a section program on CPU cannot be built statically.
LR, FORWARD, BACKWARD, OPTIMIZER = "section_lr", "section_forward", "section_backward", "section_optimizer"
SCHEDULES = ("F-then-B", "1F1B")
#: Job type of each action kind (a section program has one chunk per stage: actions carry none).
JOB_TYPES = {Kind.FORWARD: FORWARD, Kind.BACKWARD: BACKWARD}


def job_order(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list:
    """``[(job type, micro-batch id), ...]`` of one step of ``stage``.

    The actions of F-then-B or 1F1B as :mod:`paddle_hybrid.common.schedule` orders them, each as
    ``(JOB_TYPES[kind], micro)``, between the step's ``lr`` job and its ``optimizer`` job.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"paddle_hybrid.static.static_pipeline: schedule_mode {schedule!r} is not one of {SCHEDULES}.")
    if not 0 <= stage < num_stages:
        raise ValueError(f"paddle_hybrid.static.static_pipeline: stage {stage} outside 0..{num_stages - 1}.")
    if num_microbatches < 1:
        raise ValueError(f"paddle_hybrid.static.static_pipeline: accumulate_steps must be >= 1, got {num_microbatches}.")
    if schedule == "F-then-B":
        order = schedule_orders.f_then_b(num_microbatches)
    else:
        order = schedule_orders.one_f_one_b(num_stages, num_microbatches, stage)
    return [(LR, 0)] + [(JOB_TYPES[action.kind], action.micro) for action in order] + [(OPTIMIZER, 0)]
