"""Which job runs when: the order of a stage's jobs in one step, and nothing else.

A step of a legacy section program runs, like Paddle's old section worker, the ``lr`` job once
(ops with the ``LRSched`` role: learning-rate schedule and the zeroing of the ``@MERGED``
gradient accumulators), the ``forward`` and ``backward`` jobs once per micro-batch in the
schedule's order, then the ``optimizer`` job once.
"""
from __future__ import annotations

__all__ = ["SCHEDULES", "job_order", "LR", "FORWARD", "BACKWARD", "OPTIMIZER"]

# Job types.  Not Paddle's "forward"/"backward": its standalone executor demands a statically
# built interpreter for a job named "backward" (auto-parallel's rule), and the p2p ``py_func``
# ops of a section program on CPU cannot be built statically.
LR, FORWARD, BACKWARD, OPTIMIZER = "section_lr", "section_forward", "section_backward", "section_optimizer"
SCHEDULES = ("F-then-B", "1F1B")


def job_order(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list:
    """``[(job type, micro-batch id), ...]`` of one step of ``stage``.

    F-then-B: every forward, then every backward.  1F1B: ``num_stages - stage - 1`` warm-up
    forwards (at most all of them), then one forward and one backward in turn, then the
    remaining backwards; a stage never holds more than ``num_stages - stage`` micro-batches'
    activations.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"paddle_hybrid.static_pipeline: schedule_mode {schedule!r} is not one of {SCHEDULES}.")
    if not 0 <= stage < num_stages:
        raise ValueError(f"paddle_hybrid.static_pipeline: stage {stage} outside 0..{num_stages - 1}.")
    if num_microbatches < 1:
        raise ValueError(f"paddle_hybrid.static_pipeline: accumulate_steps must be >= 1, got {num_microbatches}.")
    n = num_microbatches
    if schedule == "F-then-B":
        body = [(FORWARD, i) for i in range(n)] + [(BACKWARD, i) for i in range(n)]
    else:
        warmup = min(num_stages - stage - 1, n)
        body = [(FORWARD, i) for i in range(warmup)]
        for i in range(n - warmup):
            body += [(FORWARD, warmup + i), (BACKWARD, i)]
        body += [(BACKWARD, i) for i in range(n - warmup, n)]
    return [(LR, 0)] + body + [(OPTIMIZER, 0)]
