"""Chrome Trace Event Format output of timeline events (no Paddle import).

The JSON object form (``{"traceEvents": [...], ...}``) opens in
``chrome://tracing`` and https://ui.perfetto.dev.  Layout: one process per
rank (``pid`` = rank, named ``rank N``, sorted by rank) and one thread per
track, so compute, communication and gradient sync never hide each other:

* ``compute`` (tid 0): forward / backward, named ``F3`` / ``B3`` (``F3.c1`` with a chunk);
* ``comm`` (tid 1): p2p send/recv and their waits;
* ``sync`` (tid 2): data-parallel gradient sync and the optimizer step.
"""
from __future__ import annotations

import json
import math
import os
from numbers import Real

from ._events import check_events, compute_label, is_compute

__all__ = ["TRACKS", "to_chrome_trace", "write_chrome_trace", "validate_chrome_trace"]

#: Track name and tid of each category.
TRACKS = {
    "forward": ("compute", 0),
    "backward": ("compute", 0),
    "comm": ("comm", 1),
    "grad_sync": ("sync", 2),
    "optimizer": ("sync", 2),
}

# Reserved colour names of the trace viewer (its colour scheme); only these are
# honoured, anything else is ignored or rejected by strict loaders.
_CNAME = {
    "forward": "thread_state_running",   # green
    "backward": "rail_response",         # blue
    "comm": "thread_state_iowait",       # orange
    "grad_sync": "rail_animation",       # purple
    "optimizer": "yellow",
}
_KNOWN_CNAMES = frozenset({
    "thread_state_uninterruptible", "thread_state_iowait", "thread_state_running",
    "thread_state_runnable", "thread_state_sleeping", "thread_state_unknown",
    "background_memory_dump", "light_memory_dump", "detailed_memory_dump",
    "vsync_highlight_color", "generic_work", "good", "bad", "terrible", "black", "grey",
    "white", "yellow", "olive", "rail_response", "rail_animation", "rail_idle", "rail_load",
    "startup", "heap_dump_stack_frame", "heap_dump_object_type", "heap_dump_child_node_highlight",
    "cq_build_running", "cq_build_passed", "cq_build_failed", "cq_build_abandoned",
    "cq_build_attempt_runnig", "cq_build_attempt_passed", "cq_build_attempt_failed",
})

_US = 1e6  # trace timestamps are microseconds


def _metadata(rank, tids) -> list:
    """Naming/sorting metadata of one rank's process and the tracks it uses."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    names = {tid: track for track, tid in TRACKS.values()}
    for tid in sorted(tids):
        meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": names[tid]}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return meta


def _complete_event(ev, t0) -> dict:
    """The ``ph: "X"`` event of one timeline event, times relative to ``t0``."""
    return {
        "ph": "X",
        "name": compute_label(ev) if is_compute(ev) else ev["name"],
        "cat": ev["cat"],
        "pid": ev["rank"],
        "tid": TRACKS[ev["cat"]][1],
        "ts": (ev["start"] - t0) * _US,
        "dur": (ev["end"] - ev["start"]) * _US,
        "cname": _CNAME[ev["cat"]],
        "args": {"micro": ev.get("micro"), "chunk": ev.get("chunk"), "step": ev["step"]},
    }


def to_chrome_trace(events, title="paddle_hybrid pipeline timeline") -> dict:
    """Chrome trace object of ``events``: metadata first, then complete events by (rank, track, start).

    ``ts`` / ``dur`` are microseconds from the earliest event start (kept in
    ``otherData["time_origin_s"]`` so absolute times can be recovered).
    """
    events = check_events(events)
    t0 = min((e["start"] for e in events), default=0.0)
    used = {}
    for e in events:
        used.setdefault(e["rank"], set()).add(TRACKS[e["cat"]][1])
    trace = [m for rank in sorted(used) for m in _metadata(rank, used[rank])]
    body = [_complete_event(e, t0) for e in events]
    body.sort(key=lambda x: (x["pid"], x["tid"], x["ts"], x["dur"]))
    return {
        "traceEvents": trace + body,
        "displayTimeUnit": "ms",
        "otherData": {
            "title": title,
            "generator": "paddle_hybrid.dygraph.timeline",
            "time_origin_s": t0,
            "ranks": sorted(used),
            "steps": sorted({e["step"] for e in events}),
            "num_events": len(events),
        },
    }


def write_chrome_trace(path, events, **kw) -> str:
    """Write :func:`to_chrome_trace` of ``events`` (``kw`` passed on) as JSON to ``path``; returns ``path``.

    The trace is validated first, so a file on disk always loads.
    """
    obj = to_chrome_trace(events, **kw)
    validate_chrome_trace(obj)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh)
    return path


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


_METADATA_ARGS = {
    "process_name": ("name", str),
    "thread_name": ("name", str),
    "process_sort_index": ("sort_index", int),
    "thread_sort_index": ("sort_index", int),
}


def _check_common(i, ev):
    """Keys every event needs: ph, name, integer pid and tid."""
    if not isinstance(ev, dict):
        raise ValueError(f"traceEvents[{i}]: expected an object, got {type(ev).__name__}")
    for key in ("ph", "name", "pid", "tid"):
        if key not in ev:
            raise ValueError(f"traceEvents[{i}]: missing key {key!r}")
    if ev["ph"] not in ("X", "M"):
        raise ValueError(f"traceEvents[{i}]: unexpected ph {ev['ph']!r} (expected 'X' or 'M')")
    if not isinstance(ev["name"], str):
        raise ValueError(f"traceEvents[{i}]: name must be a string")
    for key in ("pid", "tid"):
        if not _is_int(ev[key]):
            raise ValueError(f"traceEvents[{i}]: {key} must be an int, got {ev[key]!r}")


def _check_metadata(i, ev):
    """A ``ph: "M"`` event: known name and its argument of the right type."""
    if ev["name"] not in _METADATA_ARGS:
        raise ValueError(f"traceEvents[{i}]: unknown metadata name {ev['name']!r}")
    key, typ = _METADATA_ARGS[ev["name"]]
    args = ev.get("args")
    if not isinstance(args, dict) or key not in args:
        raise ValueError(f"traceEvents[{i}]: metadata {ev['name']!r} needs args.{key}")
    val = args[key]
    if not isinstance(val, typ) or isinstance(val, bool):
        raise ValueError(f"traceEvents[{i}]: metadata {ev['name']!r} args.{key} must be {typ.__name__}")


def _check_complete(i, ev):
    """A ``ph: "X"`` event: finite ts >= 0, finite dur >= 0, optional cat/args/cname well-typed."""
    for key in ("ts", "dur"):
        if key not in ev:
            raise ValueError(f"traceEvents[{i}]: missing key {key!r}")
        if not _is_number(ev[key]):
            raise ValueError(f"traceEvents[{i}]: {key} must be a finite number, got {ev[key]!r}")
    if ev["ts"] < 0:
        raise ValueError(f"traceEvents[{i}]: negative ts {ev['ts']!r}")
    if ev["dur"] < 0:
        raise ValueError(f"traceEvents[{i}]: negative dur {ev['dur']!r}")
    if "cat" in ev and not isinstance(ev["cat"], str):
        raise ValueError(f"traceEvents[{i}]: cat must be a string")
    if "args" in ev and not isinstance(ev["args"], dict):
        raise ValueError(f"traceEvents[{i}]: args must be an object")
    if "cname" in ev and ev["cname"] not in _KNOWN_CNAMES:
        raise ValueError(f"traceEvents[{i}]: unknown cname {ev['cname']!r}")


def validate_chrome_trace(obj) -> None:
    """Check ``obj`` is a well-formed trace as :func:`to_chrome_trace` writes it; ValueError names the first problem.

    Requires the object form with a ``traceEvents`` list; only ``X`` (complete)
    and ``M`` (metadata) events; each with ``name``, int ``pid``/``tid``;
    ``X`` with finite ``ts >= 0`` and ``dur >= 0``; ``M`` one of
    process/thread name/sort_index with a typed argument; and a
    ``process_name`` for every pid and a ``thread_name`` for every (pid, tid)
    a complete event uses.  ``displayTimeUnit`` if present is "ms" or "ns",
    ``otherData`` if present an object.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"trace must be an object with 'traceEvents', got {type(obj).__name__}")
    if "traceEvents" not in obj:
        raise ValueError("trace: missing key 'traceEvents'")
    if not isinstance(obj["traceEvents"], list):
        raise ValueError("trace: 'traceEvents' must be a list")
    if obj.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        raise ValueError(f"trace: displayTimeUnit must be 'ms' or 'ns', got {obj['displayTimeUnit']!r}")
    if not isinstance(obj.get("otherData", {}), dict):
        raise ValueError("trace: 'otherData' must be an object")
    named_pids, named_tids, used = set(), set(), {}
    for i, ev in enumerate(obj["traceEvents"]):
        _check_common(i, ev)
        if ev["ph"] == "M":
            _check_metadata(i, ev)
            if ev["name"] == "process_name":
                named_pids.add(ev["pid"])
            elif ev["name"] == "thread_name":
                named_tids.add((ev["pid"], ev["tid"]))
        else:
            _check_complete(i, ev)
            used.setdefault((ev["pid"], ev["tid"]), i)
    # Checked after the loop: metadata may legally come after the events it names.
    for (pid, tid), i in sorted(used.items(), key=lambda kv: kv[1]):
        if pid not in named_pids:
            raise ValueError(f"traceEvents[{i}]: no process_name metadata for pid {pid}")
        if (pid, tid) not in named_tids:
            raise ValueError(f"traceEvents[{i}]: no thread_name metadata for pid {pid} tid {tid}")
