"""CPU versions of the five MoE routing kernels Paddle registers for GPU only.

``paddle.distributed.models.moe.utils`` wraps them, and ``MoELayer`` with every gate stops on
them on a CPU build ("The kernel with key (CPU, ...) of kernel `number_count` is not
registered").  Each is a few vectorised NumPy lines over index tensors of ``tokens x top_k``
elements, far below the cost of the experts, so no C++ op is needed for them.

Where the GPU kernel's result depends on the order its threads win an atomic, the CPU version
fixes one order, named below; where the GPU kernel reads out of bounds on an input it does not
check, the CPU version raises instead.

=============================  =================================================================
kernel                         what it computes (order fixed on CPU)
=============================  =================================================================
``number_count(idx, E)``       tokens per expert ``0 .. E-1``; ``-1`` and values ``>= E`` are
                               not counted (as the GPU kernel)
``assign_pos(idx, cum)``       token positions grouped by expert, segment ``e`` ending at
                               ``cum[e]``; within an expert, tokens in ascending index order
                               (the GPU's order is whichever thread wins the atomic).  The GPU
                               kernel also decrements ``cum`` in place; this one leaves it alone
``limit_by_capacity(c, cap,    ``c`` is ``[n_worker, n_expert]`` tokens offered per worker; each
n_worker)``                    expert grants its capacity to workers in ascending worker order
                               (GPU: atomic order), partly to the worker it runs out on
``prune_gate_by_capacity(idx,  tokens beyond their expert's count become ``-1``, tokens kept in
count, E, W)``                 ascending index order (GPU: atomic order); a ``-1`` stays ``-1``
                               (the GPU kernel indexes ``count[-1]`` for it)
``random_routing(p, v, idx)``  ``idx[:, 1] = -1`` where ``2 * v[:, 1] < p`` (top-2 only)
=============================  =================================================================

Per call, the device rule: only dygraph calls with every tensor on the CPU come here; anything
else (a GPU tensor, a static program) goes to Paddle's original wrapper.
"""
from __future__ import annotations

import functools

import numpy as np

from ...registry.device import on_cpu

__all__ = ["apply", "number_count", "assign_pos", "limit_by_capacity", "prune_gate_by_capacity",
           "random_routing", "PATCHED"]


def _int64(tensor, what: str, kernel: str) -> np.ndarray:
    import paddle

    if tensor.dtype != paddle.int64:
        raise TypeError(f"paddle_hybrid.dygraph.expert_parallel: {kernel}: {what} must be int64 (as Paddle's kernel "
                        f"requires), got {tensor.dtype}.")
    return tensor.numpy()


def _out(array, like=None):
    import paddle

    return paddle.to_tensor(np.ascontiguousarray(array), dtype="int64", place=paddle.CPUPlace())


def number_count(numbers, upper_range: int):
    """Tokens per expert: ``out[e] = #{i: numbers[i] == e}`` for ``0 <= e < upper_range``."""
    flat = _int64(numbers, "numbers", "number_count").reshape(-1)
    counted = flat[(flat >= 0) & (flat < upper_range)]
    return _out(np.bincount(counted, minlength=upper_range)[:upper_range])


def _check_cum_count(flat, cum, kernel):
    valid = flat[flat > -1]
    if valid.size and valid.max() >= cum.size:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: {kernel}: expert index {int(valid.max())} but "
                         f"cum_count has {cum.size} experts; cum_count must be the cumulative sum of "
                         "number_count of the same indices.")
    expected = np.cumsum(np.bincount(valid, minlength=cum.size))
    if not np.array_equal(expected, cum):
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: {kernel}: cum_count {cum.tolist()} is not the "
                         f"cumulative token count of the indices ({expected.tolist()}); compute it as "
                         "paddle.cumsum(number_count(indices, n), axis=0).")


def assign_pos(x, cum_count):
    """Token positions sorted by expert: ``out[cum[e-1]:cum[e]]`` are the (flattened) indices of
    the tokens routed to expert ``e``, ascending."""
    flat = _int64(x, "x", "assign_pos").reshape(-1)
    cum = _int64(cum_count, "cum_count", "assign_pos").reshape(-1)
    _check_cum_count(flat, cum, "assign_pos")
    tokens = np.flatnonzero(flat > -1)
    order = np.argsort(flat[tokens], kind="stable")
    return _out(tokens[order])


def limit_by_capacity(expert_count, capacity, n_worker: int):
    """Tokens each worker may send each expert: capacity granted in ascending worker order."""
    counts = _int64(expert_count, "expert_count", "limit_by_capacity").reshape(-1)
    cap = _int64(capacity, "capacity", "limit_by_capacity").reshape(-1)
    if n_worker <= 0 or counts.size % n_worker:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: limit_by_capacity: expert_count has {counts.size} "
                         f"entries, not a multiple of n_worker={n_worker}.")
    offered = counts.reshape(n_worker, -1)
    if cap.size != offered.shape[1]:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: limit_by_capacity: capacity has {cap.size} entries "
                         f"for {offered.shape[1]} experts per worker.")
    # What is left for worker w: the capacity minus everything earlier workers offered.
    left = cap[None, :] - (np.cumsum(offered, axis=0) - offered)
    return _out(np.minimum(offered, np.maximum(left, 0)).reshape(-1))


def prune_gate_by_capacity(gate_idx, expert_count, n_expert: int, n_worker: int):
    """``gate_idx`` with every token beyond its expert's ``expert_count`` set to ``-1``; the
    first tokens (ascending index) of each expert are the ones kept."""
    idx = _int64(gate_idx, "gate_idx", "prune_gate_by_capacity")
    flat = idx.reshape(-1)
    count = _int64(expert_count, "expert_count", "prune_gate_by_capacity").reshape(-1)
    if count.size != n_expert * n_worker:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: prune_gate_by_capacity: expert_count has "
                         f"{count.size} entries, expected n_expert * n_worker = {n_expert * n_worker}.")
    if flat.size and (flat.max() >= count.size or flat.min() < -1):
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: prune_gate_by_capacity: gate index out of range "
                         f"[-1, {count.size}); got {int(flat.min())} .. {int(flat.max())}.")
    tokens = np.flatnonzero(flat > -1)
    experts = flat[tokens]
    order = np.argsort(experts, kind="stable")
    per_expert = np.bincount(experts, minlength=count.size)
    first_of_expert = np.cumsum(per_expert) - per_expert
    rank_within = np.empty_like(order)
    rank_within[order] = np.arange(order.size) - first_of_expert[experts[order]]
    out = flat.copy()
    out[tokens[rank_within >= count[experts]]] = -1
    return _out(out.reshape(idx.shape))


def random_routing(prob, topk_value, topk_idx):
    """Top-2 random routing: the second choice of row ``r`` is dropped (``-1``) when
    ``2 * topk_value[r, 1] < prob[r]``."""
    idx = _int64(topk_idx, "topk_idx", "random_routing")
    if idx.ndim != 2 or idx.shape[1] < 2:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: random_routing needs topk_idx of shape [N, 2], got "
                         f"{list(idx.shape)}.")
    value = topk_value.numpy()
    p = prob.numpy().reshape(-1)
    out = idx.copy()
    out[2 * value[:, 1] < p, 1] = -1
    return _out(out)


# ---------------------------------------------------------------------------
# the wrappers in paddle.distributed.models.moe.utils
# ---------------------------------------------------------------------------

def _on_cpu_dygraph(args) -> bool:
    import paddle

    if not paddle.in_dynamic_mode():
        return False
    tensors = [a for a in args if isinstance(a, paddle.Tensor)]
    return bool(tensors) and all(on_cpu(t) for t in tensors)


def _make(original, cpu_kernel):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not _on_cpu_dygraph(list(args) + list(kwargs.values())):
            return original(*args, **kwargs)
        return cpu_kernel(*args, **kwargs)

    return wrapper


def _random_routing_cpu(topk_idx, topk_value, prob, topk=2):
    if topk != 2:
        raise RuntimeError("only topk=2 is supported now")  # Paddle's own message and check
    return random_routing(prob, topk_value, topk_idx)


def _assign_pos_cpu(x, cum_count):
    return assign_pos(x, cum_count)


# wrapper name in paddle.distributed.models.moe.utils -> (parameters, CPU implementation)
PATCHED = {
    "_number_count": (["numbers", "upper_range"], number_count),
    "_assign_pos": (["x", "cum_count"], _assign_pos_cpu),
    "_random_routing": (["topk_idx", "topk_value", "prob", "topk"], _random_routing_cpu),
    "_limit_by_capacity": (["expert_count", "capacity", "n_worker"], limit_by_capacity),
    "_prune_gate_by_capacity": (["gate_idx", "expert_count", "n_expert", "n_worker"], prune_gate_by_capacity),
}
# ``paddle.incubate.distributed.models.moe.utils`` imported these by name.
_IMPORTED_BY_INCUBATE = ["_number_count", "_assign_pos", "_limit_by_capacity", "_prune_gate_by_capacity"]


def apply(config, patcher) -> None:
    import importlib

    utils = importlib.import_module("paddle.distributed.models.moe.utils")
    incubate_utils = importlib.import_module("paddle.incubate.distributed.models.moe.utils")
    for name, (params, _) in PATCHED.items():
        patcher.check_params(patcher.require(utils, name, "paddle.distributed.models.moe.utils"), params,
                             f"paddle.distributed.models.moe.utils.{name}")
    for name in _IMPORTED_BY_INCUBATE:
        patcher.require(incubate_utils, name, "paddle.incubate.distributed.models.moe.utils")
    for name, (_, cpu_kernel) in PATCHED.items():
        patcher.set(utils, name, _make(getattr(utils, name), cpu_kernel))
        if name in _IMPORTED_BY_INCUBATE:  # its own copy of the name: wrap what it holds
            patcher.set(incubate_utils, name, _make(getattr(incubate_utils, name), cpu_kernel))
