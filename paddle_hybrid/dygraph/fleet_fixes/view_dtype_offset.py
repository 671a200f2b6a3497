"""``Tensor.view(dtype)`` of a tensor that does not start at the beginning of its memory (a slice
such as ``flat[8:24]``) stops with a clear error instead of returning the wrong bytes.

Paddle 3.2.2 and 3.3.1, on CPU: ``view_dtype`` to a dtype of another element size reads
from the start of the tensor's memory, not from the tensor's own offset (``_offset()``), so a
slice viewed as another dtype holds its neighbours' bytes or memory past them (seen:
``paddle.arange(8, dtype="int32")[2:4].view(paddle.uint8)`` gives other bytes on each version;
the plugin's own fused pipeline messages came back as 1.9e33, then NaN).  Nothing warns.  The
same element size keeps the offset and is right.

Patch: before Paddle's ``view`` runs with a dtype, a tensor with a nonzero offset and a target of
another element size raises :class:`ViewOffsetError`, naming the offset, the dtypes and the fix
(``.clone()`` first, or ``paddle.split`` instead of slicing: both give a tensor of its own).  A
shape, the same element size, or a tensor at offset 0 go to Paddle's unchanged.  Refused rather
than copied: a view shares memory with its base, a copy would not.  Only for a tensor in host
memory: the kernel is Paddle's on every device, but it was seen wrong on CPU only, so a tensor on
an accelerator goes to Paddle unchanged (the device rule).
"""
from __future__ import annotations

import functools

__all__ = ["apply", "ViewOffsetError", "OWNERS"]

OWNERS = ("paddle", "paddle.tensor", "paddle.tensor.manipulation")


class ViewOffsetError(ValueError):
    """``view(dtype)`` of a tensor with a storage offset, which Paddle reads from the wrong place."""


def _is_dtype(value) -> bool:
    """A dtype as ``view`` takes one (Paddle's, NumPy's, a name), not a shape in any form."""
    import numpy as np
    import paddle

    return (isinstance(value, (paddle.dtype, np.dtype, str))
            or (isinstance(value, type) and issubclass(value, np.generic)))


def _dtype_argument(args, kwargs):
    value = args[0] if len(args) == 1 else kwargs.get("shape_or_dtype", kwargs.get("dtype"))
    return value if value is not None and _is_dtype(value) else None


def _check(x, dtype) -> None:
    import paddle

    if dtype is None or not isinstance(x, paddle.Tensor) or not paddle.in_dynamic_mode():
        return
    offset = x._offset() if hasattr(x, "_offset") else 0
    if not offset or not x.place.is_cpu_place():
        return
    size = paddle.empty([0], dtype=dtype).element_size()
    if size != x.element_size():
        raise ViewOffsetError(
            f"paddle_hybrid: view({dtype}) of a {x.dtype} tensor of shape {list(x.shape)} that starts {offset} bytes "
            "into its memory (a slice): Paddle's view_dtype reads from the start of the memory, not the tensor's, "
            "and would return other bytes. Call .clone() first, or split with paddle.split instead of slicing.")


def _make(original):
    @functools.wraps(original)
    def view(x, *args, **kwargs):
        _check(x, _dtype_argument(args, kwargs))
        return original(x, *args, **kwargs)

    return view


def apply(config, patcher) -> None:
    import importlib

    import paddle

    original = patcher.require(paddle.Tensor, "view", "paddle.Tensor")
    replacement = _make(original)
    patcher.set(paddle.Tensor, "view", replacement)
    for name in OWNERS:
        module = importlib.import_module(name)
        if getattr(module, "view", None) is original:
            patcher.set(module, "view", replacement)
