"""Expert parallelism (mixture of experts) on CPU over gloo.

Fleet configures expert parallelism (``hybrid_configs`` ``ep_degree``, ``"ep"`` in ``order``)
and ``fleet.init`` builds the groups on gloo, but everything that moves or routes tokens stops
on a CPU build.  Each concern below is one module:

=======================  ==============================================================
concern                  what it makes work on CPU (details in the module's docstring)
=======================  ==============================================================
:mod:`paddle_hybrid.gloo.all_to_all`
                         every all-to-all of a gloo process group (``dist.alltoall``,
                         ``alltoall_single``, ``stream.alltoall_single``, the process
                         group's own methods): a pairwise exchange, each byte sent once
:mod:`.routing_kernels`  ``number_count``, ``assign_pos``, ``limit_by_capacity``,
                         ``prune_gate_by_capacity``, ``random_routing`` (the naive,
                         gshard and switch gates of ``MoELayer``)
:mod:`.global_exchange`  ``global_scatter`` / ``global_gather``, differentiable
:mod:`.nccl_check`       ``MoELayer``'s NCCL version check on a build without NCCL
:mod:`.moe_kernels`      CPU kernels of the MoE ops ERNIE-4.5-MoE (PaddleFormers'
                         ``nn/moe/``) calls through ``paddle._C_ops``:
                         ``expand_modality_expert_id``, ``moe_gate_dispatch_partial_``
                         ``nosoftmaxtopk`` (+ grad), ``build_src_rank_and_local_expert_id``,
                         ``moe_combine`` (+ grad), ``cal_aux_loss`` (+ grad), ``int_bincount``
=======================  ==============================================================

Two defects of ``MoELayer`` that give wrong gradients or a hang on every device are fixed in
:mod:`paddle_hybrid.dygraph.fleet_fixes` (``moe_scatter_grad``, ``moe_empty_experts``).

When: ``PluginConfig.expert_parallel`` (``PADDLE_HYBRID_EXPERT_PARALLEL``): ``"auto"`` only on
a build with no accelerator (the device rule: these paths ran on CPU only), ``"on"`` on any
build, ``"off"`` never.  Installed is not the same as used: each replacement asks per call
whether its group is gloo and its tensors are on the CPU, and otherwise calls Paddle's original.
"""
from __future__ import annotations

from ...gloo import all_to_all
from ...registry.component import Component
from ...registry.patching import Patcher
from . import global_exchange, moe_kernels, nccl_check, routing_kernels

__all__ = ["COMPONENT", "apply", "CONCERNS"]

CONCERNS = (all_to_all, routing_kernels, global_exchange, nccl_check, moe_kernels)


def apply(config, patcher: Patcher) -> str:
    """Each concern in turn; report()'s note: the gate's reason, then what the concerns said."""
    from ...registry import gate

    notes = [concern.apply(config, patcher) for concern in CONCERNS]
    return "; ".join(note for note in (gate.decide(config, "expert_parallel").reason, *notes) if note)


# When: PluginConfig.expert_parallel, auto/on/off as PluginConfig.cpu (paddle_hybrid.registry.gate).
COMPONENT = Component("expert_parallel", ("3.2.", "3.3."), "expert_parallel", apply)
