"""A layout's parameters under the names one process gives them, and where each one is held.

* **Virtual pipeline stages.** A ``PipelineLayer`` with ``num_virtual_pipeline_stages`` keeps each
  chunk of its stage as a sublayer named by the chunk's first layer, the chunk's layers by their
  place in it: ``4.1.fc.weight`` is layer 4 + 1 = 5, which one process (and a pipeline without
  virtual stages) names ``5.fc.weight``.
* **Experts.** With expert parallel each rank holds ``experts / ep`` of an MoE layer's experts.
  Paddle's ``MoELayer`` keeps only those, numbered from 0 on every rank: local expert ``j`` of the
  rank at place ``r`` of the expert-parallel group is expert ``r * local + j`` of the whole model
  (``examples/moe_ep.py`` draws expert ``i``'s weights by ``i``).  PaddleFormers' MoE layers
  (``ModularMoELayer``, ERNIE-4.5-MoE's, ...) keep the whole list with ``None`` for the other ranks'
  experts, so rank 1 of 2 holds ``experts.2`` and ``experts.3`` of 4: already the whole model's
  numbers, kept as they are.

:func:`one_process_names` gives ``[(name, parameter)]`` renamed so; :func:`places` says for each
name its pipeline stage and virtual chunk (the verifier says where a difference is).
"""
from __future__ import annotations

import re

from ...common import logical_params
from ...common.replicas import expert_shards, inner_layer

__all__ = ["one_process_names", "places"]

_CHUNK_NAME = re.compile(r"^(\d+)\.(\d+)\.(.*)$")


def _chunk_starts(layer) -> dict:
    """``{sublayer name: (first layer, chunk index)}`` of a virtual-pipeline ``PipelineLayer``'s chunks."""
    chunks = layer.get_model_chunks() if hasattr(layer, "get_model_chunks") else None
    if not chunks:
        return {}
    index = {id(chunk): i for i, chunk in enumerate(chunks)}
    return {name: (int(name), index[id(child)]) for name, child in layer.named_children() if id(child) in index}


def _expert_renames(model) -> list:
    """``[(local prefix, whole-model prefix)]`` of every local expert of a layer that numbers its own
    from 0 (none for a layer holding the whole list, ``None`` in the other ranks' places)."""
    out = []
    for path, layer, group in expert_shards(model):
        if any(expert is None for expert in layer.experts):
            continue  # the whole model's list: each expert at its own number
        local = len(layer.experts)
        for j in range(local):
            out.append((f"{path}.experts.{j}.", f"{path}.experts.{group.rank * local + j}."))
    return out


def one_process_names(model) -> list:
    """``[(name, parameter)]`` of ``model``'s parameters under one process's names."""
    layer = inner_layer(model)
    starts = _chunk_starts(layer)
    experts = _expert_renames(model)
    out = []
    for name, param in logical_params.named_parameters(layer):
        match = _CHUNK_NAME.match(name)
        if match and match.group(1) in starts:
            name = f"{starts[match.group(1)][0] + int(match.group(2))}.{match.group(3)}"
        for local, whole in experts:
            if name.startswith(local):
                name = whole + name[len(local):]
                break
        out.append((name, param))
    return out


def places(model, stage: int) -> dict:
    """``{one-process name: {"stage": s, "chunk": c}}`` of a pipeline model's parameters (``chunk``
    None without virtual stages); empty for a model without a pipeline."""
    layer = inner_layer(model)
    if not hasattr(layer, "get_model_chunks"):
        return {}
    starts, chunk_of = _chunk_starts(layer), {}
    for child_name, child in layer.named_children():
        if child_name in starts:
            chunk_of.update({id(param): starts[child_name][1] for param in child.parameters()})
    return {name: {"stage": stage, "chunk": chunk_of.get(id(param))} for name, param in one_process_names(model)}
