"""Fixes of fleet defects that give wrong numbers, or stop, on every device (GPU included).

================================  ===============================================
fix                               what it fixes (details in the module docstring)
================================  ===============================================
:mod:`.shared_weight_norm`        global-norm clipping counts a weight shared
                                  between pipeline stages once per stage
:mod:`.no_pipeline_dp`            a one-stage ``PipelineLayer`` under pure data
                                  parallelism never averages its gradients
:mod:`.sharding_v2_grads`         sharding V2 reduce-scatters zeros from step 2
                                  (``clear_grad``); sharding x DP skips the DP
                                  all-reduce of every slice on step 1
:mod:`.stage3_param_groups`       group-sharded stage 3 with parameter groups
                                  updates its sliced parameters on step 1 only
:mod:`.moe_scatter_grad`          ``MoELayer`` with top-k > 1 keeps one route's
                                  gradient of a token instead of their sum
:mod:`.moe_empty_experts`         ``MoELayer``: a rank whose experts get no token
                                  skips the backward collective (the others hang)
:mod:`.tied_optimizer_state`      flex checkpoints: a tied weight's optimizer
                                  state saved under one name, looked up under
                                  another, restarts from zero with a warning
:mod:`.process_mesh_numpy2`       ``ProcessMesh.get_rank_by_dim_and_process_id``
                                  (``shard_dataloader``) stops under NumPy 2
:mod:`.one_process_model`         ``fleet.distributed_model(layer)`` in one process
                                  asserts a ``PipelineLayer``: a plain fleet
                                  script cannot run on one process
:mod:`.uneven_reshard`            ``dist.reshard`` Shard -> Shard of a dimension
                                  that does not divide by the mesh: an error on
                                  some ranks, a hang on the others
:mod:`.view_dtype_offset`         ``Tensor.view(dtype)`` of a slice, to another
                                  element size, reads the wrong bytes
:mod:`.shard_dataloader_order`    ``dist.shard_dataloader`` drops the order of
                                  the batch sampler it is given (PaddleFormers'
                                  auto-parallel Trainer read unshuffled data)
:mod:`.fsdp_grad_average`         ``fsdp.fully_shard`` (auto parallel) sums the
                                  ranks' gradients: n times the mean
:mod:`.fsdp_tied_params`          ``fsdp.fully_shard`` (auto parallel) stops on
                                  a parameter two layers share (tied embeddings)
:mod:`.empty_dist_read`           ``Tensor.numpy()`` of a DistTensor whose value
                                  was freed (fused FSDP's parameters) gives
                                  a zero-size array (now an error)
:mod:`.pipeline_degree`           a ``to_static`` 1F1B / VPP pipeline left at
                                  ``pp_degree`` 1 waits forever (now an error
                                  naming it)
================================  ===============================================

When: ``PluginConfig.fleet_fixes`` (``PADDLE_HYBRID_FLEET_FIXES``, default on).  Written
against Paddle 3.2.x and 3.3.x; on another version the registry skips them with a warning.
"""
from __future__ import annotations

from ...registry.component import Component
from ...registry.patching import Patcher, PatchSignatureError
from . import (empty_dist_read, fsdp_grad_average, fsdp_tied_params, moe_empty_experts, moe_scatter_grad, no_pipeline_dp,
               one_process_model, pipeline_degree, process_mesh_numpy2, shard_dataloader_order, sharding_v2_grads,
               shared_weight_norm, stage3_param_groups, tied_optimizer_state, uneven_reshard, view_dtype_offset)

__all__ = ["COMPONENT", "apply", "is_active", "FIXES", "PatchSignatureError"]

FIXES = (shared_weight_norm, no_pipeline_dp, sharding_v2_grads, stage3_param_groups, moe_scatter_grad,
         moe_empty_experts, tied_optimizer_state, process_mesh_numpy2, uneven_reshard, one_process_model,
         view_dtype_offset, shard_dataloader_order, fsdp_grad_average, fsdp_tied_params, pipeline_degree,
         empty_dist_read)


def apply(config, patcher: Patcher) -> None:
    for fix in FIXES:
        fix.apply(config, patcher)


COMPONENT = Component("fleet_fixes", ("3.2.", "3.3."), "fleet_fixes", apply)


def is_active() -> bool:
    return COMPONENT.is_active()
