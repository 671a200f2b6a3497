"""What the MoE gates of this process routed, kept for whoever reports it.

The dry run forces MoE routing to be balanced (:mod:`paddle_hybrid.dygraph.balanced_routing`) and
its probe (:mod:`paddle_hybrid.dygraph.dryrun_probe`) says so in the rank's record; neither feature
imports the other, so the record lives here, below both.
"""
from __future__ import annotations

__all__ = ["note", "summary", "clear"]

_RECORD: dict = {}


def note(mode: str, tokens_per_expert: list, top_k: int) -> None:
    """One routing call: how it routed (``"forced-balanced"``), the tokens this rank sent to each
    expert of the whole model (after any capacity limit), the experts per token it asked for."""
    _RECORD["mode"] = mode
    _RECORD["gate_calls"] = _RECORD.get("gate_calls", 0) + 1
    _RECORD["top_k"] = int(top_k)
    _RECORD["tokens_per_expert"] = [int(c) for c in tokens_per_expert]


def summary() -> dict | None:
    """``{"mode", "gate_calls", "top_k", "tokens_per_expert"}`` (the last call's counts), or None when
    no gate routed in this process."""
    return dict(_RECORD) if _RECORD else None


def clear() -> None:
    _RECORD.clear()
