"""Global-norm gradient clipping counts a weight shared between pipeline stages once.

A ``SharedLayerDesc`` weight (a tied embedding / LM head) lives on the first and the
last stage; after the schedule fleet sums its gradient over those stages, so every copy
holds the same full gradient.  ``HybridParallelClipGrad`` sums the squared norms of
every stage's parameters over the pipeline group and skips a parameter whose
``is_firstly_shared`` is False, meant to be every copy but the first.  Paddle 3.3.1 never
sets it: ``PipelineLayer._synchronize_shared_weights`` compares ``param.name``
(``"embedding_0.w_0"``) with the attribute names (``["weight"]``), which never match.
The shared weight's squared norm is counted once per stage holding it, the global norm
is too large, and whenever clipping is active every gradient is scaled down more than
in a single-process run (seen: the example's PP=2 loss drifts from one process by 1e-3
within 4 steps; equal without clipping).

Patch: after Paddle's ``_synchronize_shared_weights``, mark every shared weight by
attribute: ``is_firstly_shared`` is True on the lowest rank of its shared group, False
on the others.
"""
from __future__ import annotations

import functools

__all__ = ["apply", "mark_first_copies"]


def mark_first_copies(pipeline_layer) -> None:
    for comm in pipeline_layer.shared_comm.values():
        first = pipeline_layer.global_rank == min(comm["ranks"])
        for attr in comm["weight_attr"]:
            getattr(comm["layer"], attr).is_firstly_shared = first


def _make_sync(orig):
    @functools.wraps(orig)
    def _synchronize_shared_weights(self):
        orig(self)
        mark_first_copies(self)

    return _synchronize_shared_weights


def apply(config, patcher) -> None:
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

    cls = patcher.require(pp_layers, "PipelineLayer", "pp_layers")
    orig = patcher.require(cls, "_synchronize_shared_weights", "PipelineLayer")
    patcher.check_params(orig, ["self"], "PipelineLayer._synchronize_shared_weights")
    patcher.set(cls, "_synchronize_shared_weights", _make_sync(orig))
