"""Fixes of fleet defects that give wrong numbers on every device (GPU included).

============================  ===============================================
fix                           what it fixes (details in the module docstring)
============================  ===============================================
:mod:`.shared_weight_norm`    global-norm clipping counts a weight shared
                              between pipeline stages once per stage
:mod:`.no_pipeline_dp`        a one-stage ``PipelineLayer`` under pure data
                              parallelism never averages its gradients
:mod:`.sharding_v2_grads`     sharding V2 reduce-scatters zeros from step 2
                              (``clear_grad``); sharding x DP skips the DP
                              all-reduce of every slice on step 1
:mod:`.stage3_param_groups`   group-sharded stage 3 with parameter groups
                              updates its sliced parameters on step 1 only
:mod:`.moe_scatter_grad`      ``MoELayer`` with top-k > 1 keeps one route's
                              gradient of a token instead of their sum
:mod:`.moe_empty_experts`     ``MoELayer``: a rank whose experts get no token
                              skips the backward collective (the others hang)
:mod:`.tied_optimizer_state`  flex checkpoints: a tied weight's optimizer
                              state saved under one name, looked up under
                              another, restarts from zero with a warning
============================  ===============================================

When: ``PluginConfig.fleet_fixes`` (``PADDLE_HYBRID_FLEET_FIXES``, default on).  Written
against Paddle 3.2.x and 3.3.x; on another version the registry skips them with a warning.
"""
from __future__ import annotations

from ..patching import Patcher, PatchSignatureError

__all__ = ["skip_reason", "apply", "is_active", "FIXES", "VERIFIED_PADDLE", "SWITCH", "PatchSignatureError"]

VERIFIED_PADDLE = ("3.2.", "3.3.")
SWITCH = "PADDLE_HYBRID_FLEET_FIXES=0 (PluginConfig(fleet_fixes=False))"
FIXES = ["shared_weight_norm", "no_pipeline_dp", "sharding_v2_grads", "stage3_param_groups", "moe_scatter_grad",
         "moe_empty_experts", "tied_optimizer_state"]


def skip_reason(config):
    return None if config.fleet_fixes else "switched off (fleet_fixes=False)"


def apply(config, patcher: Patcher) -> None:
    patcher.apply_modules(__name__, FIXES)


def is_active() -> bool:
    from .._install import component_state

    state = component_state(__name__)
    return state is not None and state.status == "active"
