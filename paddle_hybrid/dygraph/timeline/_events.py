"""Shared vocabulary and input checks for timeline events (no Paddle import).

An event is a plain dict::

    {"rank": int, "step": int, "name": str, "cat": str,
     "start": float, "end": float, "micro": int | None, "chunk": int | None}

Times are seconds on one clock shared by all ranks (the recorder aligns them).
The analysis, trace and plot modules all go through :func:`check_events` so a
malformed event fails loudly with its index instead of producing a wrong plot.

A compute event is one op of the pipeline schedule: :func:`compute_action` turns it into the
:class:`~paddle_hybrid.common.schedule.Action` of :mod:`paddle_hybrid.common.schedule`, whose
compact form (``F3``, ``B3.c1``) is its label.  The events keep the words ``forward`` /
``backward`` in ``cat`` (the trace files' format); :data:`KIND_OF_CAT` translates.
"""
from __future__ import annotations

import math
from numbers import Real

from ...common.schedule import Action, Kind

__all__ = ["CATEGORIES", "COMPUTE", "KIND_OF_CAT", "CAT_OF_KIND", "check_events", "is_compute", "compute_action",
           "compute_label"]

#: Every category the recorder emits, in the order legends and tracks list them.
CATEGORIES = ("forward", "backward", "comm", "grad_sync", "optimizer")
#: The categories that are pipeline compute (the "busy" part of the bubble).
COMPUTE = ("forward", "backward")
#: The schedule kind of each compute category, and back.
KIND_OF_CAT = {"forward": Kind.FORWARD, "backward": Kind.BACKWARD}
CAT_OF_KIND = {kind: cat for cat, kind in KIND_OF_CAT.items()}

_REQUIRED = ("rank", "step", "name", "cat", "start", "end")


def _is_int(x) -> bool:
    # bool is an int subclass; a True rank is a bug, not rank 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_time(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def check_events(events) -> list:
    """Return ``events`` as a list after checking each one; ValueError names the first bad event.

    Checks: required keys present, ``rank``/``step`` non-negative ints,
    ``cat`` a known category, finite ``start <= end``, ``micro``/``chunk``
    None or non-negative ints.
    """
    events = list(events)
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise ValueError(f"event {i}: expected a dict, got {type(ev).__name__}")
        for key in _REQUIRED:
            if key not in ev:
                raise ValueError(f"event {i}: missing key {key!r}")
        for key in ("rank", "step"):
            if not _is_int(ev[key]) or ev[key] < 0:
                raise ValueError(f"event {i}: {key!r} must be a non-negative int, got {ev[key]!r}")
        if ev["cat"] not in CATEGORIES:
            raise ValueError(f"event {i}: unknown cat {ev['cat']!r} (expected one of {CATEGORIES})")
        if not _is_time(ev["start"]) or not _is_time(ev["end"]):
            raise ValueError(f"event {i}: start/end must be finite numbers")
        if ev["end"] < ev["start"]:
            raise ValueError(f"event {i}: end {ev['end']!r} before start {ev['start']!r}")
        for key in ("micro", "chunk"):
            val = ev.get(key)
            if val is not None and (not _is_int(val) or val < 0):
                raise ValueError(f"event {i}: {key!r} must be None or a non-negative int, got {val!r}")
    return events


def is_compute(ev) -> bool:
    """True for forward/backward events."""
    return ev["cat"] in COMPUTE


def compute_action(ev) -> Action:
    """The schedule action of a compute event (``micro`` / ``chunk`` None where the event has none)."""
    if ev["cat"] not in KIND_OF_CAT:
        raise ValueError(f"{ev['cat']!r} event {ev['name']!r} is not a compute event (expected cat in {COMPUTE})")
    return Action(KIND_OF_CAT[ev["cat"]], ev.get("micro"), ev.get("chunk"))


def compute_label(ev) -> str:
    """Short label of a compute event, its action's compact form: ``F3``, ``B3``, ``F3.c1``
    (micro-batch and chunk only when known)."""
    return str(compute_action(ev))
