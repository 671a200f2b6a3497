"""Which model chunk a fleet pipeline ``_backward_step`` call runs, on every verified Paddle.

The timeline labels backward steps by chunk and the gradient buckets mark each chunk's last
microbatch; both read it here.  Paddle 3.3 passes ``chunk_id`` (fourth argument); Paddle 3.2
has no such parameter, and its interleaved schedules set the model's virtual pipeline rank
right before each backward step instead.
"""
from __future__ import annotations

import inspect

__all__ = ["takes_chunk_id", "backward_chunk"]


def takes_chunk_id(backward_step) -> bool:
    """Does this Paddle's ``_backward_step`` take ``chunk_id`` (3.3) or not (3.2)?"""
    return "chunk_id" in inspect.signature(backward_step).parameters


def backward_chunk(model, args, kwargs, with_chunk_id: bool):
    """The chunk of ``model._backward_step(*args, **kwargs)`` (None without interleaving);
    ``with_chunk_id`` is :func:`takes_chunk_id` of the class's method, computed once."""
    if with_chunk_id:  # _backward_step(input_tensor, output_tensor, output_tensor_grad, chunk_id, ...)
        return kwargs.get("chunk_id", args[3] if len(args) > 3 else None)
    if getattr(model, "num_model_chunks", 1) > 1:
        return getattr(model, "_virtual_pp_rank", None)
    return None
