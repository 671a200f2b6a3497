"""A timed pipeline schedule: each stage's ordered forwards and backwards, run against each other
with the dependencies of fleet's pipeline, for a step-time estimate (no Paddle import).

:func:`simulate` takes every stage's order (lists of
:class:`~paddle_hybrid.common.schedule.Action`, e.g. from
:func:`~paddle_hybrid.common.schedule.one_f_one_b`,
:func:`~paddle_hybrid.common.schedule.interleaved` or
:func:`~paddle_hybrid.common.schedule.f_then_b`), the time of each op and of each message, and
returns a :class:`Timeline`: when each op ran, the step time, each stage's busy time and bubble.

The dependencies are fleet's (stage ``s`` of ``p``, chunk ``c`` of ``v``; ``c`` None without
interleaving, where there is one chunk):

* ``F`` of (micro, c) on stage ``s > 0`` needs ``F`` of (micro, c) on ``s - 1``; on stage 0,
  chunk ``c > 0`` needs ``F`` of (micro, c - 1) on the last stage (the activation goes round);
* ``B`` of (micro, c) on stage ``s < p - 1`` needs ``B`` of (micro, c) on ``s + 1``; on the last
  stage, chunk ``c < v - 1`` needs ``B`` of (micro, c + 1) on stage 0 (the gradient goes round);
* every ``B`` needs its own stage's ``F`` of (micro, c), which holds its activations.

A stage runs its ops in its order, one at a time: an op starts when the stage's previous op
ended and every input it needs has arrived, a message from another stage arriving at its
producer's end plus the message's time.  Sending costs the sender nothing (the message does not
occupy either stage): the estimate of a schedule whose p2p overlaps compute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable, NamedTuple

from ..common.schedule import BACKWARD, FORWARD, Action, Kind

__all__ = ["Event", "Timeline", "simulate"]


class Event(NamedTuple):
    """One op as it ran: ``action`` on ``rank`` (its stage) from ``start`` to ``end`` seconds."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: ``events`` sorted by start (ties: rank, then order on the rank),
    ``step_time`` the last end (0.0 for a step without ops), ``num_ranks`` the number of stages."""

    events: tuple
    step_time: float
    num_ranks: int

    def _check_rank(self, rank) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be an int in [0, {self.num_ranks}), got {rank!r}")

    def order(self, rank: int) -> list:
        """The actions of ``rank`` in the order it ran them."""
        self._check_rank(rank)
        return [e.action for e in self.events if e.rank == rank]

    def busy(self, rank: int) -> float:
        """Seconds ``rank`` computes in the step (the sum of its ops' durations)."""
        self._check_rank(rank)
        return sum(e.end - e.start for e in self.events if e.rank == rank)

    def bubble(self, rank: int) -> float:
        """Seconds ``rank`` idles in the step: ``step_time - busy(rank)``."""
        return self.step_time - self.busy(rank)


def _as_action(item, rank: int, index: int) -> Action:
    if item.__class__ is Action and item.kind.__class__ is Kind and item.micro.__class__ is int and \
            item.micro >= 0 and (item.chunk is None or (item.chunk.__class__ is int and item.chunk >= 0)):
        return item  # the common case, checked without building anything
    if isinstance(item, str):
        return Action.from_str(item)
    try:
        kind, micro, chunk = item
        action = Action(Kind(kind), micro, chunk)
    except (TypeError, ValueError):
        raise ValueError(f"orders[{rank}][{index}]: expected an Action (kind, micro, chunk), got {item!r}") from None
    for name, value, optional in (("micro", action.micro, False), ("chunk", action.chunk, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"orders[{rank}][{index}] {action}: {name} must be an int >= 0, got {value!r}")
    return action


def _check_orders(orders) -> tuple:
    """The orders as lists of actions, and the number of chunks; ValueError names the first problem."""
    if not isinstance(orders, (list, tuple)) or not orders:
        raise ValueError(f"orders must be a non-empty list with one list of actions per stage, got {orders!r}")
    out = []
    for rank, order in enumerate(orders):
        if isinstance(order, (str, bytes)) or not hasattr(order, "__iter__"):
            raise ValueError(f"orders[{rank}] must be a list of actions, got {order!r}")
        actions = [_as_action(item, rank, i) for i, item in enumerate(order)]
        seen = set()
        for action in actions:
            if action in seen:
                raise ValueError(f"stage {rank} runs {action} twice")
            seen.add(action)
        out.append(actions)
    chunks = {a.chunk for actions in out for a in actions}
    if None in chunks and len(chunks) > 1:
        raise ValueError("orders mix actions with a chunk and without one: either every action names its chunk "
                         "(interleaved) or none does")
    num_chunks = 1 if chunks <= {None} else max(chunks) + 1
    return out, num_chunks


def _inputs(action: Action, stage: int, num_stages: int, num_chunks: int) -> list:
    """``(producer action, producer stage)`` of every input of ``action`` on ``stage``."""
    kind, micro, chunk = action
    last = num_stages - 1
    if kind is FORWARD:
        if stage > 0:
            return [(action, stage - 1)]
        if chunk is not None and chunk > 0:
            return [(Action(FORWARD, micro, chunk - 1), last)]
        return []
    needs = [(Action(FORWARD, micro, chunk), stage)]
    if stage < last:
        needs.append((action, stage + 1))
    elif chunk is not None and chunk < num_chunks - 1:
        needs.append((Action(BACKWARD, micro, chunk + 1), 0))
    return needs


def _seconds(value, what) -> float:
    """``value`` as seconds; ``what()`` names it in the error (built only then: a simulation makes millions)."""
    if value.__class__ is float and 0.0 <= value < math.inf:
        return value
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what()} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def simulate(orders, duration: Callable[[int, Action], float],
             p2p: Callable[[int, int, Action], float] = lambda src, dst, a: 0.0) -> Timeline:
    """Run every stage's order against the others; return the :class:`Timeline`.

    ``orders[r]`` is stage ``r``'s actions in order (chunk None for a schedule without virtual
    stages, else every action's chunk, ``0 .. v - 1``).  ``duration(stage, action)`` is the
    seconds an op takes; ``p2p(src, dst, action)`` the seconds of the message from stage ``src``
    to stage ``dst`` that carries the output of ``action`` (the producer's: an activation for a
    forward, a gradient for a backward).  An input made on the stage itself (a backward's own
    forward; the wrap-around of a one-stage interleaved pipeline) arrives without a message.

    ValueError: a malformed order, an action run twice on a stage, an input that no stage's order
    produces, a negative or non-finite time.  RuntimeError: orders that can never finish (each
    stage waiting for an op that waits on it); the message names every stuck stage's next action
    and what it waits for.
    """
    orders, num_chunks = _check_orders(orders)
    num_stages = len(orders)
    planned = {(action, rank) for rank, actions in enumerate(orders) for action in actions}
    for rank, actions in enumerate(orders):
        for action in actions:
            for need in _inputs(action, rank, num_stages, num_chunks):
                if need not in planned:
                    raise ValueError(f"stage {rank}'s {action} needs {need[0]} of stage {need[1]}, which stage "
                                     f"{need[1]}'s order never runs")

    done = {}                       # (action, stage) -> end
    events = []                     # (start, rank, position, end, action)
    pos = [0] * num_stages          # each stage's next op
    free = [0.0] * num_stages       # when each stage's previous op ended
    waiting = {}                    # (action, stage) -> the stages waiting for it
    runnable = list(range(num_stages))
    while runnable:
        rank = runnable.pop()
        actions = orders[rank]
        while pos[rank] < len(actions):
            action = actions[pos[rank]]
            ready = free[rank]
            blocked = None
            for need in _inputs(action, rank, num_stages, num_chunks):
                if need not in done:
                    blocked = need
                    break
                src = need[1]
                message = 0.0 if src == rank else _seconds(p2p(src, rank, need[0]),
                                                           lambda: f"p2p({src}, {rank}, {need[0]})")
                ready = max(ready, done[need] + message)
            if blocked is not None:
                # resumed when what it waits for ends (an input never run was rejected above,
                # so a stage still waiting at the end is in a deadlock)
                waiting.setdefault(blocked, []).append(rank)
                break
            end = ready + _seconds(duration(rank, action), lambda: f"duration({rank}, {action})")
            done[(action, rank)] = free[rank] = end
            events.append((ready, rank, pos[rank], end, action))
            pos[rank] += 1
            runnable.extend(waiting.pop((action, rank), ()))
    stuck = [rank for rank in range(num_stages) if pos[rank] < len(orders[rank])]
    if stuck:
        parts = []
        for rank in stuck:
            action = orders[rank][pos[rank]]
            missing = [need for need in _inputs(action, rank, num_stages, num_chunks) if need not in done]
            parts.append(f"stage {rank} at {action} (waits for "
                         + ", ".join(f"{a} of stage {s}" for a, s in missing) + ")")
        raise RuntimeError("pipeline schedule deadlocks: no stage can run its next action: " + "; ".join(parts))
    events.sort(key=lambda e: e[:3])
    return Timeline(events=tuple(Event(rank, action, start, end) for start, rank, _, end, action in events),
                    step_time=max((e[3] for e in events), default=0.0), num_ranks=num_stages)
