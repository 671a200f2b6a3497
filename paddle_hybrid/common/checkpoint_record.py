"""The checkpoint loads this process answered without reading them, kept for whoever reports them.

In a dry run's fake world a flex-checkpoint load reads no weights
(:mod:`paddle_hybrid.gloo.fake_checkpoint`) and the probe (:mod:`paddle_hybrid.dygraph.dryrun_probe`)
puts what was not read in the rank's record; neither imports the other, so the record lives here,
below both (as :mod:`.routing_record` does for the MoE gates).
"""
from __future__ import annotations

__all__ = ["note", "loads", "clear"]

_LOADS: list = []


def note(entry: dict) -> None:
    """One load not read: ``{"path", "format", "tensors", "bytes", "materialized", "files", "file_bytes",
    "largest_file_bytes", "weights_read": False}`` (see :func:`paddle_hybrid.gloo.fake_checkpoint.load_entry`)."""
    _LOADS.append(dict(entry))


def loads() -> list:
    """Every load noted in this process, in call order (a copy)."""
    return [dict(entry) for entry in _LOADS]


def clear() -> None:
    del _LOADS[:]
