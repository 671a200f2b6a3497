"""Tensor parallel (``mp_degree > 1``) on gloo.

Stock Paddle 3.3.1 stops a CPU tensor-parallel run in these places; each is replaced by
autograd functions over the gloo collectives ``all_reduce`` and ``all_gather``, or by
Paddle's own code with the CPU-less kernel left out.  The device rule is asked per call:
a replacement does its work only for a dygraph call on a gloo group with tensors in host
memory, and hands anything else (static or PIR programs, NCCL/XCCL groups, device tensors)
to Paddle's original unchanged.

1. ``TensorParallel._pre_forward`` -> ``broadcast_input_data`` asserts "Only support xpu,
   gpu and custom_device now, but this is cpu".  Patch: on CPU the inputs are broadcast
   from the model-parallel source rank in place (nested lists/tuples/dicts as Paddle
   walks them) when the group is gloo and every tensor is on CPU: all their shapes in one
   message and all their bytes in another (:mod:`paddle_hybrid.common.tensor_bytes`), not
   two messages a tensor (each gloo call is a round trip); inputs holding other objects go
   one by one.
2. ``_c_identity`` (the entry of ``ColumnParallelLinear``): the CPU kernel raises "Do not
   support c_identity for cpu kernel now".  Patch: identity forward (a copy, or with
   ``skip_c_identity_dynamic`` a view), all_reduce(sum) of the gradient over the mp group
   in both cases.
3. ``_mp_allreduce`` (``RowParallelLinear``, ``VocabParallelEmbedding``): its backward
   calls the same ``c_identity`` kernel.  Patch: all_reduce(sum) forward, identity
   backward.
4. ``_c_split`` (``RowParallelLinear(input_is_parallel=False)``): the CPU kernel raises
   "Do not support c_split for cpu kernel now".  Patch: own slice of the last dim
   forward, all_gather + concat on the last dim backward.
5. ``_c_concat`` (``ColumnParallelLinear(gather_output=True)``): the CPU kernel raises
   "Do not support c_concat for cpu kernel now".  Patch: all_gather + concat on the last
   dim forward, own slice backward.
6. ``_c_softmax_with_cross_entropy`` (``ParallelCrossEntropy``): a CPU forward kernel
   exists but no grad kernel, so it cannot train.  Patch: the vocab-parallel softmax
   cross entropy (global max and sum by all_reduce, the label's logit from the rank that
   holds it), backward ``softmax - one_hot`` on the local vocab slice, ``ignore_index``
   rows zero in both.  A label outside ``[0, vocab)`` that is not ``ignore_index`` raises, as
   Paddle's kernel does (it would be in no rank's slice and the loss silently the log-sum-exp).
7. ``InnerOverlapLinear`` (``ColumnParallelLinear`` with ``mp_configs.mp_async_allreduce``)
   calls the ``c_identity`` kernel in its forward unless ``mp_skip_c_identity``.  Patch:
   on CPU its forward runs with that copy skipped (same values; its backward all-reduces
   dx itself).
8. ``mp_configs.mp_fused_linear_param_grad_add`` (with ``mp_async_allreduce``): the
   backward of ``InnerOverlapLinear`` and of ``SPInnerOverlapLinear`` (sequence parallel
   with ``sp_async_reduce_scatter``) raises NotImplementedError without the fused GPU
   kernel.  Patch: on CPU Paddle's unfused branch of the same backward.
9. ``sequence_parallel_utils.all_gather`` (``ScatterOp`` backward, ``GatherOp``,
   ``AllGatherOp``, the sequence-parallel column linear): gloo refuses a strided input
   ("The tensor must be contiguous"), e.g. the scatter of a transposed activation fed
   straight into a sequence-parallel linear.  Patch: on CPU a dense copy is gathered.
   ``SPInnerOverlapLinear`` with ``mp_configs.recompute_allgather`` gathers its saved
   input again in backward through ``dist.all_gather``: on CPU its forward works on a
   dense copy of a strided input.

``_c_lookup_table`` (``c_embedding``) and the model-parallel RNG tracker already work on
CPU and are not touched.  Every function is also reachable as
``paddle.distributed.collective.<name>``, which is patched alongside ``mp_ops``.
"""
from __future__ import annotations

import functools

from ...common.tensor_bytes import copy_from_bytes, to_bytes
from ...registry.device import is_gloo, on_cpu

__all__ = ["apply", "PATCHED_MP_OPS"]


# ---------------------------------------------------------------------------
# group helpers
# ---------------------------------------------------------------------------

def _resolve(group):
    """(group or the default group, this rank's index in it, its size)."""
    from paddle.distributed import collective

    group = collective._get_default_group() if group is None else group
    return group, group.rank, group.nranks


def _sum_(tensor, group):
    import paddle.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _gather_last_dim(tensor, group, nranks):
    import paddle
    import paddle.distributed as dist

    parts = []
    dist.all_gather(parts, tensor, group=group)
    if len(parts) != nranks:
        raise RuntimeError(f"paddle_hybrid.dygraph.cpu: all_gather returned {len(parts)} parts for {nranks} ranks.")
    return paddle.concat(parts, axis=-1)


def _own_last_dim_slice(tensor, rank, nranks):
    import paddle

    width = tensor.shape[-1]
    if width % nranks:
        raise ValueError(f"paddle_hybrid.dygraph.cpu: last dimension {width} is not divisible by the "
                         f"model-parallel degree {nranks}; make the split dimension a multiple of it.")
    return paddle.split(tensor, nranks, axis=-1)[rank].clone()


# ---------------------------------------------------------------------------
# autograd functions
# ---------------------------------------------------------------------------

def _py_layers():
    """Built on first use, so importing this module needs no Paddle."""
    import paddle
    from paddle.autograd import PyLayer

    class IdentityForwardSumBackward(PyLayer):
        @staticmethod
        def forward(ctx, x, group, copy=True):
            ctx.group = group
            # Without the copy, a view of the same memory: returning ``x`` itself (or
            # ``detach``/``reshape`` of it) makes the output an in-place result, which Paddle
            # refuses for a leaf that needs a gradient; ``view`` does not.
            return x.clone() if copy else x.view(x.shape)

        @staticmethod
        def backward(ctx, dy):
            return _sum_(dy.clone(), ctx.group)

    class SumForwardIdentityBackward(PyLayer):
        @staticmethod
        def forward(ctx, x, group):
            return _sum_(x.clone(), group)

        @staticmethod
        def backward(ctx, dy):
            return dy

    class SplitLastDim(PyLayer):
        @staticmethod
        def forward(ctx, x, group, rank, nranks):
            ctx.group, ctx.nranks = group, nranks
            return _own_last_dim_slice(x, rank, nranks)

        @staticmethod
        def backward(ctx, dy):
            return _gather_last_dim(dy, ctx.group, ctx.nranks)

    class GatherLastDim(PyLayer):
        @staticmethod
        def forward(ctx, x, group, rank, nranks):
            ctx.rank, ctx.nranks = rank, nranks
            return _gather_last_dim(x, group, nranks)

        @staticmethod
        def backward(ctx, dy):
            return _own_last_dim_slice(dy, ctx.rank, ctx.nranks)

    class VocabParallelSoftmaxCrossEntropy(PyLayer):
        """Loss of logits split over the last (vocab) dim; label holds global ids, [..., 1]."""

        @staticmethod
        def forward(ctx, logits, label, group, rank, ignore_index):
            import paddle.distributed as dist

            local_vocab = logits.shape[-1]
            start = rank * local_vocab
            # Phase 1: stable softmax over the whole vocab (global max, global sum).
            gmax = logits.max(axis=-1, keepdim=True)
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            exp = paddle.exp(logits - gmax)
            gsum = exp.sum(axis=-1, keepdim=True)
            _sum_(gsum, group)
            # Phase 2: the label's logit, contributed by the one rank whose slice holds it.
            label = label.astype("int64")
            in_slice = paddle.logical_and(label >= start, label < start + local_vocab)
            local_idx = paddle.where(in_slice, label - start, paddle.zeros_like(label))
            picked = paddle.take_along_axis(logits - gmax, local_idx, axis=-1)
            picked = paddle.where(in_slice, picked, paddle.zeros_like(picked))
            _sum_(picked, group)
            # Phase 3: loss, zero where the label is ignore_index.
            keep = (label != ignore_index).astype(logits.dtype)
            loss = (paddle.log(gsum) - picked) * keep
            softmax = exp / gsum
            ctx.save_for_backward(softmax, local_idx, in_slice.astype(logits.dtype), keep)
            ctx.mark_non_differentiable(softmax)
            return loss, softmax

        @staticmethod
        def backward(ctx, dloss, dsoftmax=None):
            softmax, local_idx, in_slice, keep = ctx.saved_tensor()
            one_hot = paddle.nn.functional.one_hot(local_idx.squeeze(-1), softmax.shape[-1])
            grad = (softmax - one_hot.astype(softmax.dtype) * in_slice) * (dloss * keep)
            return grad, None

    return {
        "identity_sum": IdentityForwardSumBackward,
        "sum_identity": SumForwardIdentityBackward,
        "split": SplitLastDim,
        "gather": GatherLastDim,
        "cross_entropy": VocabParallelSoftmaxCrossEntropy,
    }


@functools.lru_cache(maxsize=None)
def _layers():
    return _py_layers()


# ---------------------------------------------------------------------------
# replacements: ours for a dygraph call on a gloo group with a CPU tensor, else Paddle's
# ---------------------------------------------------------------------------

def _ours(group, tensor) -> bool:
    """The device rule, asked per call: the emulations were written and tested for dygraph
    calls on gloo groups with tensors in host memory; anything else (static or PIR
    programs, NCCL/XCCL groups, device tensors on a build that has them) goes to Paddle."""
    import paddle
    import paddle.distributed as dist

    if group is None and not dist.is_initialized():  # no default group to ask about
        return False
    return paddle.in_dynamic_mode() and is_gloo(group) and on_cpu(tensor)


def _keeps_original(orig, replacement):
    """``replacement`` wrapped to look like ``orig``, which it remembers for :func:`apply`."""
    wrapper = functools.wraps(orig)(replacement)
    wrapper.__wrapped_original__ = orig
    return wrapper


def _not_member(group):
    return group is not None and not group.is_member()


def _make_c_identity(orig):
    def _c_identity(tensor, group=None, skip_c_identity_dynamic=False):
        if not _ours(group, tensor):
            return orig(tensor, group=group, skip_c_identity_dynamic=skip_c_identity_dynamic)
        if _not_member(group):
            return None
        group, _, _ = _resolve(group)
        # skip_c_identity_dynamic (mp_skip_c_identity) skips the forward copy only: the
        # backward still sums the gradient over the group, as Paddle's c_identity_eager does.
        return _layers()["identity_sum"].apply(tensor, group, not skip_c_identity_dynamic)

    return _keeps_original(orig, _c_identity)


def _make_mp_allreduce(orig):
    def _mp_allreduce(tensor, op=None, group=None, use_calc_stream=True, use_model_parallel=True,
                      skip_c_identity_dynamic=False):
        from paddle.distributed import ReduceOp

        if not _ours(group, tensor):
            return orig(tensor, op=ReduceOp.SUM if op is None else op, group=group,
                        use_calc_stream=use_calc_stream, use_model_parallel=use_model_parallel,
                        skip_c_identity_dynamic=skip_c_identity_dynamic)
        if _not_member(group):
            return None
        if op is not None and op != ReduceOp.SUM:
            raise ValueError(f"paddle_hybrid.dygraph.cpu: _mp_allreduce supports ReduceOp.SUM only, got {op}.")
        group, _, _ = _resolve(group)
        # The backward is the identity with or without skip_c_identity_dynamic (Paddle's
        # c_identity kernel on dy is a copy), so the flag changes nothing here.
        return _layers()["sum_identity"].apply(tensor, group)

    return _keeps_original(orig, _mp_allreduce)


def _make_last_dim(layer_key):
    """``_c_split`` (own slice forward) or ``_c_concat`` (gather forward): same arguments,
    the autograd function named by ``layer_key`` ("split" or "gather")."""

    def make(orig):
        def last_dim_op(tensor, group=None):
            if not _ours(group, tensor):
                return orig(tensor, group=group)
            if _not_member(group):
                return None
            group, rank, nranks = _resolve(group)
            return _layers()[layer_key].apply(tensor, group, rank, nranks)

        return _keeps_original(orig, last_dim_op)

    return make


_make_c_split = _make_last_dim("split")
_make_c_concat = _make_last_dim("gather")


def _check_label_bounds(label, vocab: int, nranks: int, ignore_index: int) -> None:
    """Paddle's kernel refuses a label outside ``[0, vocab)`` that is not ``ignore_index``; without
    this check such a label is in no rank's slice, picks nothing, and the loss silently becomes the
    log-sum-exp.  Every rank holds the same labels, so every rank raises."""
    import paddle

    label = label.astype("int64")
    bad = paddle.logical_and(label != ignore_index, paddle.logical_or(label < 0, label >= vocab))
    if bool(bad.any()):
        values = sorted(set(label[bad].numpy().ravel().tolist()))
        raise ValueError(
            f"paddle_hybrid.dygraph.cpu: ParallelCrossEntropy got label {values[0]} (bad values: {values[:8]}); a label "
            f"must be in [0, {vocab}) (the vocabulary, {vocab // nranks} per rank on {nranks} ranks) or equal "
            f"ignore_index ({ignore_index}). Check the tokenizer's vocabulary size against the model's.")


def _make_cross_entropy(orig):
    def _c_softmax_with_cross_entropy(logits, label, group=None, return_softmax=False, ignore_index=-100):
        import paddle

        if not _ours(group, logits):
            return orig(logits, label, group=group, return_softmax=return_softmax, ignore_index=ignore_index)
        if _not_member(group):
            return None
        group, rank, nranks = _resolve(group)
        if len(label.shape) == len(logits.shape) - 1:
            label = paddle.unsqueeze(label, axis=-1)
        if len(label.shape) != len(logits.shape) or label.shape[-1] != 1:
            raise ValueError(
                f"paddle_hybrid.dygraph.cpu: ParallelCrossEntropy on CPU takes hard labels of shape "
                f"logits.shape[:-1] or logits.shape[:-1] + [1]; got label {label.shape} for logits "
                f"{logits.shape}.")
        _check_label_bounds(label, logits.shape[-1] * nranks, nranks, ignore_index)
        loss, softmax = _layers()["cross_entropy"].apply(logits, label, group, rank, ignore_index)
        return (loss, softmax) if return_softmax else loss

    return _keeps_original(orig, _c_softmax_with_cross_entropy)


# ---------------------------------------------------------------------------
# 1. input broadcast
# ---------------------------------------------------------------------------

def _broadcast_tensor_(tensor, group, src):
    """Broadcast ``tensor`` from ``src`` in place; a rank whose tensor has another shape
    takes the source's (as Paddle's GPU path does)."""
    import paddle
    import paddle.distributed as dist

    shape = paddle.to_tensor(list(tensor.shape) + [0] * (8 - len(tensor.shape)) + [len(tensor.shape)],
                             dtype="int64")
    dist.broadcast(shape, src=src, group=group)
    ndim = int(shape[-1])
    src_shape = [int(d) for d in shape.numpy()[:ndim]]
    if src_shape == list(tensor.shape):
        dist.broadcast(tensor, src=src, group=group)
        return
    buffer = paddle.zeros(src_shape, dtype=tensor.dtype)
    dist.broadcast(buffer, src=src, group=group)
    # assign resizes the destination; _share_buffer_to (Paddle's GPU path) keeps the old
    # shape over the new buffer and reads past its end.
    paddle.assign(buffer, output=tensor)


def _broadcast_nested_(data, group, src):
    import paddle
    import paddle.distributed as dist

    if isinstance(data, paddle.Tensor):
        if len(data.shape) > 8:
            raise ValueError(f"paddle_hybrid.dygraph.cpu: broadcast_input_data supports up to 8 dims, got {data.shape}.")
        with paddle.no_grad():
            _broadcast_tensor_(data, group, src)
    elif isinstance(data, dict):
        for value in data.values():
            _broadcast_nested_(value, group, src)
    elif isinstance(data, (list, tuple)):
        for value in data:
            _broadcast_nested_(value, group, src)
    else:
        dist.broadcast_object_list([data], src=src, group=group)


def _tensors(data):
    """Every tensor in ``data``, walked as :func:`_broadcast_nested_` walks it."""
    import paddle

    if isinstance(data, paddle.Tensor):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from _tensors(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from _tensors(value)


def _inputs_ours(group, inputs, kwargs) -> bool:
    """The device rule for the input broadcast: a gloo group and every tensor on CPU (no
    tensor at all: new tensors are placed on CPU)."""
    from ...registry.device import running_on_cpu

    if not is_gloo(group):
        return False
    tensors = list(_tensors((inputs, kwargs)))
    return all(on_cpu(t) for t in tensors) if tensors else running_on_cpu()


def _broadcast_all_tensors_(data, group, src) -> bool:
    """Every tensor of ``data`` from ``src`` with two broadcasts in all (their shapes in one
    message, their bytes in another) instead of two a tensor: each gloo call is a round trip.
    A rank whose tensor has another shape takes the source's, as :func:`_broadcast_tensor_`.
    Returns False, having sent nothing, where ``data`` holds something else than tensors
    (those go one by one, each object with ``broadcast_object_list``)."""
    import paddle
    import paddle.distributed as dist

    tensors = list(_tensors(data))
    if not tensors or len(tensors) != _count_leaves(data) or any(len(t.shape) > 8 for t in tensors):
        return False
    with paddle.no_grad():
        rows = [list(t.shape) + [0] * (8 - len(t.shape)) + [len(t.shape)] for t in tensors]
        shapes = paddle.to_tensor(rows, dtype="int64")
        dist.broadcast(shapes, src=src, group=group)
        for tensor, row in zip(tensors, shapes.numpy().tolist()):
            src_shape = row[:row[8]]
            if src_shape != list(tensor.shape):
                paddle.assign(paddle.zeros(src_shape, dtype=tensor.dtype), output=tensor)
        flat = to_bytes(tensors)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            copy_from_bytes(flat, tensors)
    return True


def _count_leaves(data) -> int:
    """How many leaves :func:`_broadcast_nested_` would broadcast (tensors and other objects)."""
    if isinstance(data, dict):
        return sum(_count_leaves(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(_count_leaves(v) for v in data)
    return 1


def _make_broadcast_input_data(orig):
    def broadcast_input_data(hcg, *inputs, **kwargs):
        group = hcg.get_model_parallel_group()
        if not _inputs_ours(group, inputs, kwargs):
            return orig(hcg, *inputs, **kwargs)
        src = hcg.get_model_parallel_group_src_rank()
        if not _broadcast_all_tensors_((inputs, kwargs), group, src):
            _broadcast_nested_(inputs, group, src)
            _broadcast_nested_(kwargs, group, src)
        return inputs, kwargs

    return _keeps_original(orig, broadcast_input_data)


# ---------------------------------------------------------------------------
# 7-8. the overlapped linears (mp_configs.mp_async_allreduce, sp_async_reduce_scatter)
# ---------------------------------------------------------------------------

# InnerOverlapLinear.forward's parameters in 3.3.1: the replacement passes them on by position.
_OVERLAP_FORWARD_PARAMS = ["ctx", "x", "weight", "bias", "fuse_matmul_bias", "mp_async_allreduce",
                           "mp_skip_c_identity", "mp_fused_linear_param_grad_add", "model_parallel_group"]


def _make_overlap_forward(orig):
    """``InnerOverlapLinear.forward`` calls the ``c_identity`` kernel on ``x`` unless
    ``mp_skip_c_identity``; on CPU that kernel raises.  Inside a PyLayer forward the kernel
    is only a copy (nothing records it for autograd: this layer's own backward all-reduces
    dx), so a CPU/gloo call runs Paddle's forward with the copy skipped: same values."""

    def forward(ctx, x, weight, bias, fuse_matmul_bias, mp_async_allreduce, mp_skip_c_identity,
                mp_fused_linear_param_grad_add, model_parallel_group):
        if _ours(model_parallel_group, x):
            mp_skip_c_identity = True
        return orig(ctx, x, weight, bias, fuse_matmul_bias, mp_async_allreduce, mp_skip_c_identity,
                    mp_fused_linear_param_grad_add, model_parallel_group)

    return _keeps_original(orig, forward)


def _make_unfused_backward(orig):
    """The backward of ``InnerOverlapLinear`` / ``SPInnerOverlapLinear``: with
    ``mp_fused_linear_param_grad_add`` it needs the fused GPU kernel of that name and raises
    NotImplementedError on CPU.  A CPU/gloo call runs Paddle's own unfused branch instead
    (``dw = x^T dy``, ``dbias = sum(dy)`` returned to autograd, which adds them to ``.grad``,
    or MixPrecisionLayer's hook to ``main_grad``): the same sums the fused kernel forms in place."""

    def backward(ctx, dy):
        if not (ctx.mp_fused_linear_param_grad_add and _ours(ctx.model_parallel_group, dy)):
            return orig(ctx, dy)
        ctx.mp_fused_linear_param_grad_add = False
        try:
            return orig(ctx, dy)
        finally:
            ctx.mp_fused_linear_param_grad_add = True

    return _keeps_original(orig, backward)


# SPInnerOverlapLinear.forward's parameters in 3.3.1.
_SP_OVERLAP_FORWARD_PARAMS = ["ctx", "x", "weight", "bias", "fuse_matmul_bias", "recompute_allgather",
                              "mp_fused_linear_param_grad_add", "model_parallel_group"]


def _make_sp_overlap_forward(orig):
    """``SPInnerOverlapLinear`` with ``recompute_allgather`` saves ``x`` and all-gathers it
    again in backward with ``dist.all_gather``, which gloo refuses for a strided ``x``
    (the scatter of a transposed activation).  A CPU/gloo call runs Paddle's forward on a
    dense copy of such an ``x``: same values, and autograd still routes dx to the input."""

    def forward(ctx, x, weight, bias, fuse_matmul_bias, recompute_allgather, mp_fused_linear_param_grad_add,
                model_parallel_group):
        if _ours(model_parallel_group, x) and not x.is_contiguous():
            x = x.clone()
        return orig(ctx, x, weight, bias, fuse_matmul_bias, recompute_allgather, mp_fused_linear_param_grad_add,
                    model_parallel_group)

    return _keeps_original(orig, forward)


def _check_overlap_linears(patcher):
    """The two overlapped linear PyLayers, their signatures checked (before any change)."""
    from paddle.distributed.fleet.layers.mpu import mp_layers
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    inner = patcher.require(mp_layers, "InnerOverlapLinear", "mp_layers")
    sp_inner = patcher.require(spu, "SPInnerOverlapLinear", "sequence_parallel_utils")
    patcher.check_params(inner.forward, _OVERLAP_FORWARD_PARAMS, "mp_layers.InnerOverlapLinear.forward")
    patcher.check_params(sp_inner.forward, _SP_OVERLAP_FORWARD_PARAMS,
                         "sequence_parallel_utils.SPInnerOverlapLinear.forward")
    for cls, where in ((inner, "mp_layers"), (sp_inner, "sequence_parallel_utils")):
        patcher.check_params(cls.backward, ["ctx", "dy"], f"{where}.{cls.__name__}.backward")
    return inner, sp_inner


def _patch_overlap_linears(patcher, inner, sp_inner) -> None:
    # PyLayer looks forward and backward up on the class at each call; there they are
    # staticmethods, so the replacements are too.
    patcher.set(inner, "forward", staticmethod(_make_overlap_forward(inner.forward)))
    patcher.set(sp_inner, "forward", staticmethod(_make_sp_overlap_forward(sp_inner.forward)))
    for cls in (inner, sp_inner):
        patcher.set(cls, "backward", staticmethod(_make_unfused_backward(cls.backward)))


# ---------------------------------------------------------------------------
# 9. sequence parallel all_gather of a strided tensor
# ---------------------------------------------------------------------------

def _make_sp_all_gather(orig):
    """``sequence_parallel_utils.all_gather`` hands its input straight to the process group,
    and gloo refuses a strided view ("The tensor must be contiguous"): ``ScatterOp`` of a
    transposed ``[b, s, h]`` activation is one, and so is what a sequence-parallel linear
    gathers when it follows the scatter directly.  A CPU/gloo call gathers a dense copy."""

    def all_gather(input):  # noqa: A002  (Paddle's parameter name)
        from paddle.distributed import fleet

        group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
        if _ours(group, input) and not input.is_contiguous():
            # a dense copy; ``Tensor.contiguous()`` would re-lay the caller's tensor in place
            input = input.clone()
        return orig(input)

    return _keeps_original(orig, all_gather)


# ---------------------------------------------------------------------------

# mp_ops functions replaced: the parameter names they were written against (3.3.1) and
# the maker of the replacement.
PATCHED_MP_OPS = {
    "_c_identity": (["tensor", "group", "skip_c_identity_dynamic"], _make_c_identity),
    "_mp_allreduce": (["tensor", "op", "group", "use_calc_stream", "use_model_parallel",
                       "skip_c_identity_dynamic"], _make_mp_allreduce),
    "_c_split": (["tensor", "group"], _make_c_split),
    "_c_concat": (["tensor", "group"], _make_c_concat),
    "_c_softmax_with_cross_entropy": (["logits", "label", "group", "return_softmax", "ignore_index"],
                                      _make_cross_entropy),
}


def apply(config, patcher) -> None:
    import paddle.distributed.collective as collective
    from paddle.distributed.fleet.layers.mpu import mp_ops
    from paddle.distributed.fleet.meta_parallel import tensor_parallel
    from paddle.distributed.fleet.utils import hybrid_parallel_util
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    for name, (params, _) in PATCHED_MP_OPS.items():
        patcher.check_params(patcher.require(mp_ops, name, "mp_ops"), params, f"mp_ops.{name}")
    bcast = patcher.require(hybrid_parallel_util, "broadcast_input_data", "hybrid_parallel_util")
    patcher.check_params(bcast, ["hcg", "inputs", "kwargs"], "hybrid_parallel_util.broadcast_input_data")
    patcher.require(tensor_parallel, "broadcast_input_data", "meta_parallel.tensor_parallel")
    overlap_linears = _check_overlap_linears(patcher)
    sp_all_gather = patcher.require(spu, "all_gather", "sequence_parallel_utils")
    patcher.check_params(sp_all_gather, ["input"], "sequence_parallel_utils.all_gather")

    for name, (_, maker) in PATCHED_MP_OPS.items():
        replacement = maker(getattr(mp_ops, name))
        patcher.set(mp_ops, name, replacement)
        if getattr(collective, name, None) is replacement.__wrapped_original__:
            patcher.set(collective, name, replacement)
    new_bcast = _make_broadcast_input_data(bcast)
    patcher.set(hybrid_parallel_util, "broadcast_input_data", new_bcast)
    patcher.set(tensor_parallel, "broadcast_input_data", new_bcast)
    _patch_overlap_linears(patcher, *overlap_linears)
    # ScatterOp, GatherOp, AllGatherOp, ReduceScatterOp and SPInnerOverlapLinear look the
    # module's all_gather up at each call.
    patcher.set(spu, "all_gather", _make_sp_all_gather(sp_all_gather))
