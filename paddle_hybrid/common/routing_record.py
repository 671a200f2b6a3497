"""What the MoE gates of this process routed, and the experts its MoE layers hold, kept for whoever
reports it.

The dry run forces MoE routing to be balanced (:mod:`paddle_hybrid.dygraph.balanced_routing`) and
its probe (:mod:`paddle_hybrid.dygraph.dryrun_probe`) says so in the rank's record; neither feature
imports the other, so the record lives here, below both.

The experts: a gate is called by its MoE layer's ``forward``, so at each routing call the nearest
caller whose ``self`` has ``experts`` (Paddle's ``MoELayer``, PaddleFormers' ``ModularMoELayer``,
ERNIE-4.5-MoE's layer, the one-process sparse blocks) is the layer that routed; each such layer is
counted once: the experts it holds on this rank (a PaddleFormers layer keeps ``None`` in the other
ranks' places: not counted) and their parameters' bytes.  Taken when the layer routes, so the
figures are there however early a script drops its model; only in a process whose record the dry
run's probe writes (``PluginConfig.dryrun_probe``, a dry run's rank or a real run held against it):
elsewhere nobody reports them, and the search is not made.
"""
from __future__ import annotations

import sys

__all__ = ["note", "summary", "clear", "held_experts"]

_RECORD: dict = {}
_LAYERS: dict = {}  # id(MoE layer) -> {"experts", "parameters_bytes"}, in the order they first routed
_DEPTH = 40  # frames searched above a routing call for its MoE layer
_PROBED: list = []  # [whether the dry run's probe records this process], decided at the first routing call


def note(mode: str, tokens_per_expert: list, top_k: int) -> None:
    """One routing call: how it routed (``"forced-balanced"``), the tokens this rank sent to each
    expert of the whole model (after any capacity limit), the experts per token it asked for."""
    _RECORD["mode"] = mode
    _RECORD["gate_calls"] = _RECORD.get("gate_calls", 0) + 1
    _RECORD["top_k"] = int(top_k)
    _RECORD["tokens_per_expert"] = [int(c) for c in tokens_per_expert]
    if not _probed():
        return
    layer = _routing_layer(sys._getframe(1))
    if layer is not None and id(layer) not in _LAYERS:
        _LAYERS[id(layer)] = held_experts(layer)


def _probed() -> bool:
    if not _PROBED:
        from ..config import PluginConfig

        _PROBED.append(bool(PluginConfig.from_env().dryrun_probe))
    return _PROBED[0]


def _routing_layer(frame):
    """The nearest caller's ``self`` that holds ``experts`` (the MoE layer whose gate routed), or None."""
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        experts = getattr(owner, "experts", None) if hasattr(owner, "parameters") else None
        if isinstance(experts, (list, tuple)) or hasattr(experts, "parameters"):  # a count of experts is not them
            return owner
        frame = frame.f_back
    return None


def held_experts(layer) -> dict:
    """``{"experts", "parameters_bytes"}`` of the experts ``layer`` holds in this process: the entries of
    its ``experts`` list that are not ``None`` (a module of stacked experts counts as
    ``num_local_experts`` or ``num_experts`` of its own, else 1), and the bytes of their parameters."""
    from .tensor_bytes import nbytes

    experts = layer.experts
    try:
        held = [e for e in experts if e is not None]
        count = len(held)
    except TypeError:  # one module holding every expert's weights stacked
        held = [experts]
        count = int(getattr(experts, "num_local_experts", 0) or getattr(experts, "num_experts", 0) or 1)
    params = {id(p): p for e in held for p in e.parameters()}
    return {"experts": count, "parameters_bytes": int(sum(nbytes(p) for p in params.values()))}


def summary() -> dict | None:
    """``{"mode", "gate_calls", "top_k", "tokens_per_expert"}`` (the last call's counts) and, in a process
    the dry run's probe records, where the MoE layers were found, ``"moe_layers"`` (how many routed),
    ``"experts_per_layer"`` (each one's experts here, in the order they first routed), ``"experts_held"``
    (their sum) and ``"expert_parameters_bytes"``; None when no gate routed in this process."""
    if not _RECORD:
        return None
    out = dict(_RECORD)
    if _LAYERS:
        layers = list(_LAYERS.values())
        out.update(moe_layers=len(layers), experts_per_layer=[e["experts"] for e in layers],
                   experts_held=sum(e["experts"] for e in layers),
                   expert_parameters_bytes=sum(e["parameters_bytes"] for e in layers))
    return out


def clear() -> None:
    _RECORD.clear()
    _LAYERS.clear()
    _PROBED.clear()
