"""The order of a pipeline stage's forwards and backwards in one step, and the one vocabulary every
module speaks it in.

An op of a schedule is an :class:`Action`: its :class:`Kind` (forward or backward), its micro-batch
and, in an interleaved (virtual pipeline) schedule, its model chunk.  It prints compactly, ``F3``,
``B0``, ``F3.c1``, and :meth:`Action.from_str` reads that form back, so orders, labels and error
messages all name an op the same way.  The users:

* the static pipeline maps actions onto its job types
  (:func:`paddle_hybrid.static.static_pipeline.schedule.job_order`);
* the timeline turns its compute events into actions for labels and order checks
  (:func:`paddle_hybrid.dygraph.timeline._events.compute_action`);
* the ideal timelines simulate these orders (:mod:`paddle_hybrid.testing.ideal_timeline`).

Callers check their arguments (each with the words of its own API); the order functions only order.
"""
from __future__ import annotations

import enum
import re
from typing import NamedTuple, Optional

__all__ = ["Kind", "Action", "FORWARD", "BACKWARD", "one_f_one_b", "f_then_b"]


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


def f_then_b(num_micro: int) -> list[Action]:
    """Every forward, then every backward."""
    return _actions(FORWARD, range(num_micro)) + _actions(BACKWARD, range(num_micro))
