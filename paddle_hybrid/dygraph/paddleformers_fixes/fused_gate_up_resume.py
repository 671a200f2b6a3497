"""A flex checkpoint of a fused gate/up projection, resumed at another tensor-parallel degree: refused (every
device), because it loads permuted columns without an error.

PaddleFormers 1.2's ``paddleformers.nn.mlp.MLP(fuse_up_gate=True)`` (ERNIE-4.5 dense and MoE, GLM4-MoE's dense
layer and shared experts) holds one column-parallel ``up_gate_proj`` of width 2I.  Each tensor-parallel rank
computes its gate and up parts from its own piece, so a rank's piece is ``[its gate columns | its up
columns]``; the flex checkpoint (the column-parallel linear's ``sharded_state_dict``) saves the pieces
joined in rank order, ``[g0|u0|g1|u1]`` at TP2, where one process holds ``[gate|up]``.  Loaded at another
degree, each rank takes the columns at its offset: the weight comes back permuted, and training goes on
from another model.  Measured (``tests/dygraph/paddleformers_fixes/test_moe_ep4_and_resume.py``, tiny
models): ERNIE-4.5-MoE EP2 -> EP1, 2048 of the 4096 elements of ``model.layers.0.mlp.up_gate_proj.weight``
wrong, the step-3 loss 4.60823 where the uninterrupted run has 4.63838; GLM4-MoE 5.34388 against 5.15941;
dense ERNIE-4.5 TP2 -> one process 4.67191 against 4.62050.  At the same degree the resume is exact.

Refused in ``Trainer._load_flex_checkpoint`` before anything loads: each fused projection's pieces along
its columns in the checkpoint's metadata (the degree it was saved at) against this layout's, naming the
parameters, both degrees and the way out (resume at the saved ``--tensor_model_parallel_size``).  Not
remapped: the saved join does not record the degree's gate/up boundary in any field the loader reads.
"""
from __future__ import annotations

import os

__all__ = ["FusedGateUpResumeError", "check", "fused_parameter_names", "saved_degree"]


class FusedGateUpResumeError(RuntimeError):
    """A fused gate/up projection's checkpoint saved at another tensor-parallel degree than this layout's."""


def fused_parameter_names(model) -> set:
    """Names of the parameters of every fused gate/up projection in ``model``."""
    try:
        from paddleformers.nn.mlp import MLP
    except ImportError:
        return set()
    names = set()
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, MLP) and getattr(layer, "fuse_up_gate", False):
            fused = getattr(layer, layer.gate_up_proj_name, None)
            if fused is not None:
                names.update(p.name for p in fused.parameters())
    return names


def saved_degree(entries, axis: int) -> int:
    """How many pieces the saved chunks of one tensor make along ``axis`` (replicas counted once)."""
    return len({tuple(entry.global_offset)[axis] for entry in entries})


def _model_metadata(checkpoint: str):
    from paddleformers.utils.env import MODEL_STATE_DIC

    folder = os.path.join(checkpoint, MODEL_STATE_DIC)
    files = [f for f in os.listdir(folder) if f.endswith(".metadata")] if os.path.isdir(folder) else []
    if len(files) != 1:
        return None  # not a flex checkpoint this check can read: the Trainer says what is wrong
    import paddle

    return paddle.load(os.path.join(folder, files[0]))


def check(model, checkpoint: str) -> None:
    """Raise :class:`FusedGateUpResumeError` when ``checkpoint`` holds a fused gate/up projection of
    ``model`` saved at another tensor-parallel degree than ``model`` has now."""
    fused = fused_parameter_names(model)
    if not fused:
        return
    metadata = _model_metadata(checkpoint)
    if metadata is None:
        return
    wrong = []
    for key, sharded in model.sharded_state_dict().items():
        if sharded.local_tensor.name not in fused:
            continue
        entries = (metadata.state_dict_metadata or {}).get(key)
        if not entries:
            continue
        axis = len(sharded.global_shape) - 1  # the columns (a column-parallel weight's and bias's last axis)
        now = int(sharded.global_shape[axis]) // max(int(sharded.local_shape[axis]), 1)
        saved = saved_degree(entries, axis)
        if saved != now:
            wrong.append((key, saved, now))
    if wrong:
        saved_degrees = sorted({s for _, s, _ in wrong})
        raise FusedGateUpResumeError(
            f"paddle_hybrid: {checkpoint} holds fused gate/up projections saved at tensor-parallel degree "
            f"{'/'.join(map(str, saved_degrees))}, and this layout splits them {wrong[0][2]} ways "
            f"({len(wrong)} tensors: {', '.join(k for k, _, _ in wrong[:4])}{', ...' if len(wrong) > 4 else ''}). "
            "A rank's piece of such a projection is [its gate | its up], and the checkpoint joins the pieces in "
            "rank order, so loading it at another degree permutes the columns without an error. Resume with "
            f"--tensor_model_parallel_size {saved_degrees[0]} (and the expert-parallel degree that goes with it).")
