"""Pipeline bubble, communication share and schedule checks from timeline events (no Paddle import).

Definitions (all per optimizer step):

* **step window**: ``[min start, max end]`` over the forward/backward events of
  that step on *all* ranks.  Using one window for every rank is what makes the
  measured bubble comparable with the theoretical one: the first stage starts
  early and the last stage finishes its forwards late, and both idle spans
  belong to the pipeline's bubble.
* **measured bubble** of a rank: ``1 - busy / window length``, ``busy`` the
  length of the union of that rank's forward/backward intervals (overlaps
  merged so concurrent kernels are not counted twice).
* **comm share** of a rank: length of the union of its ``comm`` intervals
  inside the window, divided by the window length.

For the ideal 1F1B schedule (p stages, m microbatches, F = B = one unit) the
window is ``2 (m + p - 1)`` units and each rank computes ``2 m`` units, so the
measured bubble is ``(p - 1) / (m + p - 1)`` = :func:`theoretical_bubble`.
"""
from __future__ import annotations

from ._events import COMPUTE, check_events, compute_action, is_compute

__all__ = [
    "theoretical_bubble",
    "step_window",
    "measured_bubble",
    "comm_share",
    "summary",
    "format_summary",
    "compute_order",
    "overlapping_compute",
]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def theoretical_bubble(num_stages, num_micro, num_chunks=1) -> float:
    """Idle fraction ``(p - 1) / (v m + p - 1)`` of a pipeline with p stages, m microbatches, v chunks.

    ``num_chunks == 1`` is plain 1F1B; ``v > 1`` is the interleaved (virtual
    pipeline) schedule, whose bubble shrinks by about ``v``.
    """
    _positive_int("num_stages", num_stages)
    _positive_int("num_micro", num_micro)
    _positive_int("num_chunks", num_chunks)
    p, m, v = num_stages, num_micro, num_chunks
    return (p - 1) / (v * m + p - 1)


def _union_length(intervals, lo, hi) -> float:
    """Length of the union of ``(start, end)`` intervals clipped to ``[lo, hi]``."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo))
    total = 0.0
    cur_s = cur_e = None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def step_window(events, step) -> tuple:
    """``(start, end)`` of ``step``: first compute start to last compute end over all ranks.

    ValueError when the step has no compute events or the window has zero length.
    """
    comp = [e for e in check_events(events) if e["step"] == step and is_compute(e)]
    if not comp:
        raise ValueError(f"no forward/backward events for step {step}")
    lo, hi = min(e["start"] for e in comp), max(e["end"] for e in comp)
    if hi <= lo:
        raise ValueError(f"step {step} has a zero-length compute window")
    return lo, hi


def _rank_intervals(events, rank, step, cats):
    """Intervals of ``rank``'s events of ``step`` in ``cats``; ValueError for a rank that never appears."""
    if not any(e["rank"] == rank for e in events):
        raise ValueError(f"no events for rank {rank}")
    return [(e["start"], e["end"]) for e in events
            if e["rank"] == rank and e["step"] == step and e["cat"] in cats]


def measured_bubble(events, rank, step) -> float:
    """Idle fraction of ``rank`` in ``step``: ``1 - busy / window``.

    ``window`` is :func:`step_window` (first compute start to last compute end
    over all ranks in the step) and ``busy`` the merged length of the rank's
    forward + backward intervals in the step.  A rank without compute in the
    step has bubble 1.0.  Equals :func:`theoretical_bubble` for an ideal
    1F1B schedule with equal-length F and B.
    """
    events = check_events(events)
    lo, hi = step_window(events, step)
    busy = _union_length(_rank_intervals(events, rank, step, COMPUTE), lo, hi)
    return 1.0 - busy / (hi - lo)


def comm_share(events, rank, step) -> float:
    """Fraction of the :func:`step_window` of ``step`` that ``rank`` spends in ``comm`` events (overlaps merged).

    Only the part of a comm event inside the window counts (a recv posted
    before the first forward is not pipeline time).
    """
    events = check_events(events)
    lo, hi = step_window(events, step)
    return _union_length(_rank_intervals(events, rank, step, ("comm",)), lo, hi) / (hi - lo)


def summary(events, num_stages, num_micro, num_chunks=1) -> dict:
    """Per-rank statistics: ``{rank: {"measured", "theoretical", "comm_share", "steps", "per_step"}}``.

    ``measured`` (the :func:`measured_bubble`) and ``comm_share`` are means over the steps in ``steps``: every
    step with compute events, except step 0 when there are others (warm-up:
    allocation, first-call compilation).  ``per_step`` maps every step,
    including step 0, to ``{"measured": .., "comm_share": ..}``.
    ``theoretical`` is :func:`theoretical_bubble` of the given configuration.
    """
    events = check_events(events)
    theory = theoretical_bubble(num_stages, num_micro, num_chunks)
    all_steps = sorted({e["step"] for e in events if is_compute(e)})
    if not all_steps:
        raise ValueError("no forward/backward events")
    steps = [s for s in all_steps if s != 0] if len(all_steps) > 1 else all_steps
    out = {}
    for rank in sorted({e["rank"] for e in events}):
        per_step = {s: {"measured": measured_bubble(events, rank, s), "comm_share": comm_share(events, rank, s)}
                    for s in all_steps}
        out[rank] = {
            "measured": sum(per_step[s]["measured"] for s in steps) / len(steps),
            "theoretical": theory,
            "comm_share": sum(per_step[s]["comm_share"] for s in steps) / len(steps),
            "steps": steps,
            "per_step": per_step,
        }
    return out


def format_summary(summary) -> str:
    """A small fixed-width text table of a :func:`summary` result, one line per rank."""
    header = f"{'rank':>4}  {'steps':>5}  {'bubble':>7}  {'theory':>7}  {'comm':>7}"
    lines = [header, "-" * len(header)]
    for rank in sorted(summary):
        row = summary[rank]
        lines.append(f"{rank:>4}  {len(row['steps']):>5}  {row['measured']:>7.1%}  "
                     f"{row['theoretical']:>7.1%}  {row['comm_share']:>7.1%}")
    return "\n".join(lines)


def compute_order(events, rank, step) -> list:
    """The :class:`~paddle_hybrid.common.schedule.Action` of each of ``rank``'s compute events in
    ``step`` (``[F0, F1, B0, ...]``), by start time.

    Ties on start are broken by end so a zero-length event does not jump ahead
    of the one it precedes.  Compare with the schedule fleet intends to run, e.g. a list of
    :mod:`paddle_hybrid.common.schedule`; an action is a ``(kind, micro, chunk)`` tuple and
    equals ``("F", 3, None)``.
    """
    comp = [e for e in check_events(events) if e["rank"] == rank and e["step"] == step and is_compute(e)]
    comp.sort(key=lambda e: (e["start"], e["end"]))
    return [compute_action(e) for e in comp]


def overlapping_compute(events, tol=0.0) -> list:
    """Pairs ``(a, b)`` of compute events on one rank that overlap by more than ``tol`` seconds.

    A rank runs one compute stream, so any pair here means a recorder bug or
    misaligned events.  Touching events (``a.end == b.start``) do not overlap.
    Pairs are ordered by ``a``'s start.
    """
    by_rank = {}
    for e in check_events(events):
        if is_compute(e):
            by_rank.setdefault(e["rank"], []).append(e)
    pairs = []
    for rank in sorted(by_rank):
        active = []  # events started earlier that may still be running
        for e in sorted(by_rank[rank], key=lambda x: (x["start"], x["end"])):
            active = [a for a in active if a["end"] - e["start"] > tol]
            pairs.extend((a, e) for a in active if min(a["end"], e["end"]) - e["start"] > tol)
            active.append(e)
    return pairs
