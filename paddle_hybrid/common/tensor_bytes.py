"""Several tensors of any dtypes as one flat ``uint8`` message, and back: what a fused gloo
message carries (the pipeline's tuples, tensor parallelism's inputs).

Paddle's ``view(dtype)`` of a tensor that starts inside its memory (a slice: a microbatch cut
from a batch) reads from the start of the memory to another element size
(``dygraph/fleet_fixes/view_dtype_offset.py``), so such a tensor is copied before its bytes are
viewed, and a received message is cut with ``paddle.split`` (parts of their own), never sliced.
"""
from __future__ import annotations

__all__ = ["nbytes", "to_bytes", "copy_from_bytes"]


def nbytes(tensor) -> int:
    return int(tensor.numel()) * tensor.element_size()


def _bytes_of(tensor):
    import paddle

    flat = tensor.reshape([-1])
    if flat._offset():
        flat = flat.clone()
    return flat.view(paddle.uint8)


def to_bytes(tensors):
    """One ``uint8`` tensor holding the bytes of ``tensors``, one after the other."""
    import paddle

    with paddle.no_grad():
        return paddle.concat([_bytes_of(t) for t in tensors])


def copy_from_bytes(flat, tensors) -> None:
    """Write the parts of ``flat`` (as :func:`to_bytes` laid them out) into ``tensors`` in place."""
    import paddle

    with paddle.no_grad():
        parts = paddle.split(flat, [nbytes(t) for t in tensors])
        for tensor, part in zip(tensors, parts):
            paddle.assign(part.view(tensor.dtype).reshape(tensor.shape), output=tensor)
