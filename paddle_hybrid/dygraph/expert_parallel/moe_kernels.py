"""CPU kernels for the MoE ops of ERNIE-4.5-MoE (PaddleFormers' ``nn/moe/``), which Paddle 3.3
registers for GPU and XPU only.

PaddleFormers 1.2's ``MOEAllGatherLayerV2`` (ERNIE-4.5-MoE's sparse block) and ``TopKGate`` call
these through ``paddle.incubate.nn.functional``, whose wrappers call ``paddle._C_ops.<op>``: the
op, its InferMeta and its autograd node are in Paddle's CPU wheel, only the kernel factory has no
CPU entry, and the first forward stops with "The kernel `expand_modality_expert_id` is not
registered".  ``custom_ops/moe_cpu_kernels.cc`` (in the plugin's op library) holds a CPU kernel
for each; :func:`apply` enters them into ``phi::KernelFactory`` for CPU keys that have none, and
the patcher removes exactly those entries at ``paddle_hybrid.uninstall()``.

=============================================  =====================================================
op (kernel names registered for CPU)           what it computes
=============================================  =====================================================
``expand_modality_expert_id``                  a top-k expert id moved into the two-modality
                                               layout (and offset per slot for grouped experts)
``moe_gate_dispatch_partial_nosoftmaxtopk``    the tokens routed to this rank's experts, grouped
(+ ``_grad``)                                  by expert, at most ``capacity`` each (slot 0 first,
                                               then by token), ordered by token; the weights of
                                               the pairs not kept set to 0; the index maps both
                                               ways; the pairs per expert
``build_src_rank_and_local_expert_id``         per gathered row: its expert's rank and local index
``moe_combine`` (+ ``moe_combine_grad``)       ``y[s] = sum_i w[s, i] * x[index[s, i]]``
``cal_aux_loss`` (+ ``_grad``)                 the gate's load-balancing loss
``int_bincount``                               counts of the values in ``[low, high)``
=============================================  =====================================================

Where the GPU kernel leaves an order to its threads, the CPU kernel fixes one: the tokens of an
expert ascending, floating-point sums in index order.  The exact semantics, with the GPU
source's cases (capacity with and without padding, ``reverse_token_drop``, an expert with no
token), are in the C++ file's comments.

The device rule: a CPU entry is used only for CPU tensors; GPU and XPU keep Paddle's kernels.
Python-level stand-ins for PaddleFormers' ``create_async_load`` / ``async_offload`` (no
``AsyncLoad`` in the CPU build) are in ``paddle_hybrid.dygraph.paddleformers_fixes.moe_cpu_ops``.
"""
from __future__ import annotations

import ctypes

__all__ = ["apply", "OPS", "registered", "library", "VERIFIED_PADDLE"]

# The kernels take each op's arguments as Paddle 3.3 defines them (read from the CPU wheel's exported
# ``paddle::experimental::<op>`` signatures); Paddle calls a kernel through a pointer of that type, so on
# another Paddle they are not entered.
VERIFIED_PADDLE = ("3.3.",)

# The ops whose CPU kernels the library provides (forward and backward names).
OPS = ("expand_modality_expert_id", "moe_gate_dispatch_partial_nosoftmaxtopk",
       "moe_gate_dispatch_partial_nosoftmaxtopk_grad", "build_src_rank_and_local_expert_id", "moe_combine",
       "moe_combine_grad", "cal_aux_loss", "cal_aux_loss_grad", "int_bincount")


def library():
    """The plugin's op library (already loaded by ``paddle_hybrid.ops``), for its C entry points."""
    from ... import ops

    lib = ctypes.CDLL(ops.library_path())
    for name in ("ph_moe_register_cpu_kernels", "ph_moe_unregister_cpu_kernels", "ph_moe_cpu_kernels_registered"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def registered() -> int:
    """How many (op, data type) CPU entries of this library are in Paddle's kernel factory now."""
    return int(library().ph_moe_cpu_kernels_registered())


def _paddle_has_cpu_kernels() -> list:
    """The ops of :data:`OPS` that already have a CPU kernel of Paddle's own (a later Paddle)."""
    from paddle.base import core

    kernels = core._get_registered_phi_kernels("function")
    return [op for op in OPS if any("CPU" in key for key in kernels.get(op, []))]


def apply(config, patcher) -> str:
    """Enter the CPU kernels where Paddle has none; their removal is the patcher's to undo."""
    import paddle

    if not paddle.__version__.startswith(VERIFIED_PADDLE):
        return (f"no CPU kernels for the MoE ops of PaddleFormers' nn/moe on Paddle {paddle.__version__} (their "
                f"arguments are Paddle {'/'.join(v + 'x' for v in VERIFIED_PADDLE)}'s)")
    own = _paddle_has_cpu_kernels() if _can_list() else []
    lib = library()
    added = int(lib.ph_moe_register_cpu_kernels())
    patcher.on_revert(lambda: lib.ph_moe_unregister_cpu_kernels(), "the CPU kernels of the MoE ops "
                      "(paddle_hybrid.dygraph.expert_parallel.moe_kernels)")
    note = f"CPU kernels for {len(OPS)} MoE ops of PaddleFormers' nn/moe ({added} entries)"
    if own:
        note += f"; Paddle's own CPU kernels kept for {', '.join(own)}"
    return note


def _can_list() -> bool:
    from paddle.base import core

    return hasattr(core, "_get_registered_phi_kernels")
