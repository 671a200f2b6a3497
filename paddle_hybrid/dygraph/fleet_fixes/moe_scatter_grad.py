"""``MoELayer`` with top-k > 1: a token's input gradient is the sum over all its routes.

``MoEScatter`` (``paddle.incubate.distributed.models.moe.moe_layer``) sends every token to
each of its ``k`` experts; ``pos // k`` names the token each routed row came from, so with
``k > 1`` every token appears ``k`` times.  Its backward brings the rows' gradients back with
``_local_gather``, a ``paddle.scatter(..., overwrite=True)``: of a token's ``k`` gradient rows
only one survives (whichever the scatter writes last), so the gradient reaching the layer's input
(and everything before it) is wrong on every device, with no error.  FastMoE, where the layer
comes from, accumulates there (``index_add_``).

Patch: ``MoEScatter.backward`` does what Paddle's does but sums the rows of one token
(``paddle.index_add``); ``MoEGather``'s forward, whose positions are unique, is left alone.
"""
from __future__ import annotations

__all__ = ["apply", "scatter_backward_summing_routes"]


def _sum_rows_by_token(rows, token_of_row, n_tokens):
    """``out[t] = sum of rows[r] with token_of_row[r] == t`` (zeros for a token without rows)."""
    import paddle

    out = paddle.zeros([n_tokens, rows.shape[-1]], dtype="float32")
    if token_of_row.shape[0] == 0:
        return out.astype(rows.dtype)
    summed = paddle.index_add(out, token_of_row, 0, rows.astype("float32"))
    return summed.astype(rows.dtype)


def scatter_backward_summing_routes(ctx, grad):
    """``MoEScatter.backward``: Paddle's, with the routes of one token summed."""
    import importlib

    moe_layer = importlib.import_module("paddle.incubate.distributed.models.moe.moe_layer")
    pos, local_expert_count, global_expert_count = ctx.saved_tensor()
    inp_batch_size, world_size, group = ctx.moe_args
    if world_size > 1:
        # Looked up at call time: the expert_parallel component may provide the gloo version.
        local_grad_in = moe_layer.global_gather(grad, local_expert_count, global_expert_count, group=group)
    else:
        local_grad_in = grad
    return _sum_rows_by_token(local_grad_in, pos, inp_batch_size), None, None, None


def apply(config, patcher) -> None:
    import importlib
    import inspect

    moe_layer = importlib.import_module("paddle.incubate.distributed.models.moe.moe_layer")
    scatter = patcher.require(moe_layer, "MoEScatter", "moe_layer")
    patcher.check_params(scatter.forward, ["ctx", "inp", "pos", "local_expert_count", "global_expert_count",
                                           "fwd_batch_size", "world_size", "group"], "MoEScatter.forward")
    patcher.check_params(scatter.backward, ["ctx", "grad"], "MoEScatter.backward")
    source = inspect.getsource(scatter.backward)
    if "_local_gather(local_grad_in, pos, inp_batch_size)" not in source:
        raise RuntimeError("moe_layer.MoEScatter.backward is not the one this fix was written for (it no "
                           "longer calls _local_gather(local_grad_in, pos, inp_batch_size)); unexpected Paddle.")
    patcher.set(scatter, "backward", staticmethod(scatter_backward_summing_routes))
