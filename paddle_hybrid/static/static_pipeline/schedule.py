"""Which job runs when: the order of a stage's jobs in one step, and nothing else.

A step of a legacy section program runs, like Paddle's old section worker, the ``lr`` job once
(ops with the ``LRSched`` role: learning-rate schedule and the zeroing of the ``@MERGED``
gradient accumulators), the ``forward`` and ``backward`` jobs once per micro-batch in the
schedule's order, then the ``optimizer`` job once.
"""
from __future__ import annotations

from ...common import schedule as schedule_orders

__all__ = ["SCHEDULES", "job_order", "LR", "FORWARD", "BACKWARD", "OPTIMIZER"]

# Job types.  Not Paddle's "forward"/"backward": its standalone executor demands a statically
# built interpreter for a job named "backward" (auto-parallel's rule), and the p2p ``py_func``
# ops of a section program on CPU cannot be built statically.
LR, FORWARD, BACKWARD, OPTIMIZER = "section_lr", "section_forward", "section_backward", "section_optimizer"
SCHEDULES = ("F-then-B", "1F1B")


def job_order(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list:
    """``[(job type, micro-batch id), ...]`` of one step of ``stage``.

    F-then-B and 1F1B as :mod:`paddle_hybrid.common.schedule` orders them, between the step's
    ``lr`` job and its ``optimizer`` job.
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
    job = {schedule_orders.FORWARD: FORWARD, schedule_orders.BACKWARD: BACKWARD}
    return [(LR, 0)] + [(job[kind], micro) for kind, micro in order] + [(OPTIMIZER, 0)]
