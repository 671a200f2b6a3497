"""Ideal pipeline timelines built by simulation, for tests and docs (no Paddle import).

The generator simulates dependencies rather than writing closed-form start
times, so the tests of :mod:`paddle_hybrid.dygraph.timeline.bubble` check the bubble
formula against an independent construction instead of against itself.  The per-stage order
is :func:`paddle_hybrid.common.schedule.one_f_one_b`, the one the static pipeline runs, as a list
of :class:`~paddle_hybrid.common.schedule.Action`; an event is an action with a rank and times.
"""
from __future__ import annotations

from ..common.schedule import FORWARD, Action
from ..common.schedule import one_f_one_b as _one_f_one_b
from ..dygraph.timeline._events import CAT_OF_KIND

__all__ = ["one_f_one_b_order", "one_f_one_b"]


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def one_f_one_b_order(num_stages, num_micro, stage) -> list[Action]:
    """The 1F1B actions of ``stage`` (``[F0, B0, F1, ...]``), arguments checked."""
    _check_positive_int("num_stages", num_stages)
    _check_positive_int("num_micro", num_micro)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage!r}")
    return _one_f_one_b(num_stages, num_micro, stage)


def _ready_time(action, stage, num_stages, done):
    """When the cross-stage input of ``action`` on ``stage`` is available, or None if not produced yet.

    Communication costs nothing: F of micro i on stage s needs F of i on s-1,
    B of i on s needs B of i on s+1 (the last stage's B needs only its own F,
    which the per-stage order already puts earlier): the same action, one stage up or down.
    """
    source = stage - 1 if action.kind == FORWARD else stage + 1
    if not 0 <= source < num_stages:
        return 0.0
    return done.get((action, source))


def _event(action, stage, step, start, end) -> dict:
    return {"rank": stage, "step": step, "name": str(action.kind), "cat": CAT_OF_KIND[action.kind],
            "start": start, "end": end, "micro": action.micro, "chunk": action.chunk}


def one_f_one_b(num_stages, num_micro, f=1.0, b=1.0, step=0):
    """Events of the ideal 1F1B timeline: ``num_stages`` ranks, forward ``f`` and backward ``b`` seconds.

    Each stage runs :func:`one_f_one_b_order`; an op starts when both the
    previous op on its stage and its cross-stage input have finished.  The
    step lasts ``(num_micro + num_stages - 1) * (f + b)`` and every stage
    computes ``num_micro * (f + b)`` of it.
    Rank ``s`` is stage ``s``; events are ``cat`` forward/backward, name
    ``"F"``/``"B"``, ``chunk`` None, sorted by (start, rank).
    """
    _check_positive_int("num_stages", num_stages)
    _check_positive_int("num_micro", num_micro)
    if not (f > 0 and b > 0):
        raise ValueError(f"f and b must be > 0, got f={f!r}, b={b!r}")
    orders = [one_f_one_b_order(num_stages, num_micro, s) for s in range(num_stages)]
    pos = [0] * num_stages          # next op index per stage
    free = [0.0] * num_stages       # when each stage finishes its previous op
    done = {}                       # (action, stage) -> end time
    events = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(num_stages):
            # Run as many ops of stage s as have their inputs; the others wait for
            # a later sweep, which is how a real stage blocks on its recv.
            while pos[s] < len(orders[s]):
                action = orders[s][pos[s]]
                ready = _ready_time(action, s, num_stages, done)
                if ready is None:
                    break
                start = max(free[s], ready)
                end = start + (f if action.kind == FORWARD else b)
                done[(action, s)] = free[s] = end
                events.append(_event(action, s, step, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for 1F1B; guards edits of the order
            waiting = ", ".join(f"stage {s} at {orders[s][pos[s]]}" for s in range(num_stages)
                                if pos[s] < len(orders[s]))
            raise RuntimeError(f"schedule deadlocks: no stage can run its next op ({waiting})")
    events.sort(key=lambda e: (e["start"], e["rank"]))
    return events
