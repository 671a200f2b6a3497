"""The order of a pipeline stage's forwards and backwards in one step, and the one vocabulary every
module speaks it in.

An op of a schedule is an :class:`Action`: its :class:`Kind` (forward or backward), its micro-batch
and, in an interleaved (virtual pipeline) schedule, its model chunk.  It prints compactly, ``F3``,
``B0``, ``F3.c1``, and :meth:`Action.from_str` reads that form back, so orders, labels and error
messages all name an op the same way.  The orders are the ones fleet runs on a stage:
:func:`one_f_one_b` (``PipelineParallel``), :func:`interleaved` (``PipelineParallelWithInterleave``)
and :func:`f_then_b` (every forward, then every backward).  The users:

* the static pipeline maps actions onto its job types
  (:func:`paddle_hybrid.static.static_pipeline.schedule.job_order`);
* the timeline turns its compute events into actions for labels and order checks
  (:func:`paddle_hybrid.dygraph.timeline._events.compute_action`);
* the ideal timelines simulate these orders (:mod:`paddle_hybrid.testing.ideal_timeline`), and so
  does the step-time simulator (:func:`paddle_hybrid.plan.simulate.simulate`).

Callers check their arguments (each with the words of its own API); the order functions only order.
"""
from __future__ import annotations

import enum
import re
from typing import NamedTuple, Optional

__all__ = ["Kind", "Action", "FORWARD", "BACKWARD", "one_f_one_b", "interleaved", "f_then_b"]


class Kind(str, enum.Enum):
    """What an action computes; prints as its letter.

    A ``str`` enum equal to (and hashing like) ``"F"`` / ``"B"``: code that compared ops with the
    plain tuples ``("F", micro)`` of earlier versions keeps working.
    """

    FORWARD = "F"
    BACKWARD = "B"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec) -> str:
        # Enum's own __format__ of a mixed-in enum differs between Python versions.
        return format(self.value, spec)

    # Enum hashes the member name ("FORWARD"); a dict keyed by actions must find ("F", 3, None).
    __hash__ = str.__hash__


FORWARD, BACKWARD = Kind.FORWARD, Kind.BACKWARD

# Canonical numbers only (no "F03"), so that from_str(text) prints back as text.
_NUMBER = r"(0|[1-9][0-9]*)"
_ACTION_FORM = re.compile(rf"({'|'.join(k.value for k in Kind)}){_NUMBER}?(?:\.c{_NUMBER})?")


class Action(NamedTuple):
    """One op of a schedule: ``kind`` of micro-batch ``micro`` on model chunk ``chunk``.

    ``chunk`` is None outside an interleaved schedule; ``micro`` is None only where it is unknown
    (a timeline event that did not record it).  ``str`` and ``repr`` are the compact form, so a list
    of actions prints as ``[F0, F1, B0]``.
    """

    kind: Kind
    micro: Optional[int]
    chunk: Optional[int] = None

    def __str__(self) -> str:
        text = str(self.kind) + ("" if self.micro is None else str(self.micro))
        return text if self.chunk is None else f"{text}.c{self.chunk}"

    __repr__ = __str__

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """The action printed as ``text`` (``F3``, ``B0``, ``F3.c1``); ValueError for any other text."""
        match = _ACTION_FORM.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not a schedule action: expected <F|B>[<micro>][.c<chunk>], "
                             "e.g. 'F3', 'B0' or 'F3.c1'")
        kind, micro, chunk = match.groups()
        return cls(Kind(kind), None if micro is None else int(micro), None if chunk is None else int(chunk))


def _actions(kind: Kind, micros) -> list[Action]:
    return [Action(kind, i) for i in micros]


def one_f_one_b(num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """Fleet's non-interleaved 1F1B order of ``stage``: ``min(num_stages - stage - 1, num_micro)``
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards; a
    stage never holds more than ``num_stages - stage`` micro-batches' activations."""
    warmup = min(num_stages - stage - 1, num_micro)
    order = _actions(FORWARD, range(warmup))
    for k in range(num_micro - warmup):
        order += [Action(FORWARD, warmup + k), Action(BACKWARD, k)]
    return order + _actions(BACKWARD, range(num_micro - warmup, num_micro))


def _interleaved_chunk(step: int, num_stages: int, num_micro: int, num_chunks: int, kind: Kind) -> int:
    """The chunk of virtual micro step ``step`` (fleet's ``_get_virtual_pp_rank``, without its
    ``best_unbalanced_scheduler`` variant): the first ``num_micro % num_stages + num_stages``
    steps run chunk 0, as many chunk 1, ... up to the last chunk; then groups of ``num_stages``
    steps go round the chunks.  A backward step runs the chunks from the last one down."""
    first = num_micro % num_stages + num_stages
    if step < first * num_chunks:
        chunk = step // first
    else:
        chunk = (step - first * num_chunks) % (num_stages * num_chunks) // num_stages
    return chunk if kind is FORWARD else num_chunks - 1 - chunk


def _interleaved_actions(kind: Kind, num_stages: int, num_micro: int, num_chunks: int) -> list[Action]:
    """Every virtual micro step of ``kind`` as an action: its chunk, and as micro-batch the count of
    earlier steps on that chunk (fleet's ``_forward_micro_step_counter`` / ``_backward_...``)."""
    seen = [0] * num_chunks
    actions = []
    for step in range(num_micro * num_chunks):
        chunk = _interleaved_chunk(step, num_stages, num_micro, num_chunks, kind)
        actions.append(Action(kind, seen[chunk], chunk))
        seen[chunk] += 1
    return actions


def interleaved(num_stages: int, num_micro: int, num_chunks: int, stage: int) -> list[Action]:
    """Fleet's interleaved (virtual pipeline) 1F1B order of ``stage``, each action with its chunk.

    ``PipelineParallelWithInterleave.forward_backward_pipeline`` (Paddle 3.2 and 3.3, the default
    settings: neither ``best_unbalanced_scheduler`` nor the forward-backward overlap schedule,
    which adds a warm-up step) runs ``num_micro * num_chunks`` virtual forward steps and as many
    backward steps: ``2 * (num_stages - stage - 1) + (num_chunks - 1) * first`` warm-up forwards
    (``first = num_micro % num_stages + num_stages``; all of them when that is more), then one
    forward and one backward in turn, then the remaining backwards.  Forward step ``k`` runs chunk
    ``k // first`` for ``k < first * num_chunks``, later chunk ``(k - first * num_chunks) %
    (num_stages * num_chunks) // num_stages``; backward step ``k`` the mirror chunk
    ``num_chunks - 1 - that``; each chunk takes its micro-batches in order.  Fleet builds this
    schedule for ``num_chunks >= 2`` and ``num_micro >= 2 * num_stages`` (with fewer micro-batches
    it runs every forward first); ``num_chunks == 1`` is not :func:`one_f_one_b` (twice the warm-up).
    """
    forwards = _interleaved_actions(FORWARD, num_stages, num_micro, num_chunks)
    backwards = _interleaved_actions(BACKWARD, num_stages, num_micro, num_chunks)
    first = num_micro % num_stages + num_stages
    warmup = min(2 * (num_stages - stage - 1) + (num_chunks - 1) * first, len(forwards))
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(forwards) - warmup:]


def f_then_b(num_micro: int) -> list[Action]:
    """Every forward, then every backward."""
    return _actions(FORWARD, range(num_micro)) + _actions(BACKWARD, range(num_micro))
