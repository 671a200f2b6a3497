"""Several tensors as one flat message, and back: what a fused gloo collective carries (stage-1
sharding's gradients and parameters, the pipeline's tuples, tensor parallelism's inputs).

:func:`concat_flat` / :func:`copy_into` for tensors of one dtype (a reduce needs numbers);
:func:`to_bytes` / :func:`copy_from_bytes` for tensors of any dtypes (a copy needs only bytes).
Paddle's ``view(dtype)`` of a tensor that starts inside its memory (a slice: a microbatch cut
from a batch) reads from the start of the memory to another element size
(``dygraph/fleet_fixes/view_dtype_offset.py``), so such a tensor is copied before its bytes are
viewed, and a received message is cut with ``paddle.split`` (parts of their own), never sliced.
"""
from __future__ import annotations

import os

__all__ = ["nbytes", "concat_flat", "copy_into", "to_bytes", "copy_from_bytes", "paddle_checks_each_tensor"]


def nbytes(tensor) -> int:
    # _numel() is a plain int; numel() would run a Paddle op per call (every p2p message and collective)
    return tensor._numel() * tensor.element_size()


def paddle_checks_each_tensor() -> bool:
    """Whether Paddle checks every tensor it communicates for NaN/Inf (``FLAGS_pp_check_naninf``,
    read per call as Paddle reads it): a fused message would skip those checks, so callers leave
    the communication to Paddle then."""
    return os.getenv("FLAGS_pp_check_naninf", "0").lower() in ("1", "true", "t", "y", "yes", "on")


def concat_flat(tensors):
    """One 1-D tensor holding ``tensors`` (all of one dtype) one after the other; for a single
    tensor, a flat view of it (no copy)."""
    import paddle

    flat = [t.reshape([-1]) for t in tensors]
    return paddle.concat(flat) if len(flat) > 1 else flat[0]


def copy_into(flat, tensors) -> None:
    """Write the parts of ``flat`` (as :func:`concat_flat` laid them out) into ``tensors`` in
    place: their identities are kept (the optimizer and fleet hold them)."""
    _assign_parts(flat, tensors, [int(t.numel()) for t in tensors], lambda part, tensor: part)


def _bytes_of(tensor):
    import paddle

    flat = tensor.reshape([-1])
    if flat._offset():
        flat = flat.clone()
    return flat.view(paddle.uint8)


def to_bytes(tensors):
    """One ``uint8`` tensor holding the bytes of ``tensors`` (any dtypes), one after the other."""
    import paddle

    with paddle.no_grad():
        return concat_flat([_bytes_of(t) for t in tensors])


def copy_from_bytes(flat, tensors) -> None:
    """Write the parts of ``flat`` (as :func:`to_bytes` laid them out) into ``tensors`` in place."""
    _assign_parts(flat, tensors, [nbytes(t) for t in tensors], lambda part, tensor: part.view(tensor.dtype))


def _assign_parts(flat, tensors, sizes, as_dtype) -> None:
    import paddle

    with paddle.no_grad():
        parts = paddle.split(flat, sizes) if len(tensors) > 1 else [flat]
        for tensor, part in zip(tensors, parts):
            paddle.assign(as_dtype(part, tensor).reshape(tensor.shape), output=tensor)
