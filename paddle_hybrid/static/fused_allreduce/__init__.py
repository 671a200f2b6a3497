"""Fused gradient all_reduce for static data parallel (legacy IR programs).

* :mod:`.plan`: which gradients go together (config, groups, the layout ranks compare);
* :mod:`.rewrite`: the program rewrite, the startup broadcast and the Paddle pass
  ``ph_fuse_allreduce`` (:class:`FuseAllreducePass`);
* :mod:`.meta_optimizer`: ``FusedAllreduceOptimizer``, fleet's strategy mapped onto the pass;
* :mod:`.runner`: :class:`StaticRunner`, running a rewritten program (CPU: through PIR on gloo);
* :mod:`.pir_repair`: the repair of Paddle 3.3.1's legacy->PIR translation of the plugin's ops.

The component ``fused_allreduce`` (``PluginConfig.fused_allreduce``,
``PADDLE_HYBRID_FUSED_ALLREDUCE``; tri-state: on where it has run, a build with no accelerator)
makes the meta optimizer known to fleet, carrying the config, and the pass known to Paddle;
``paddle_hybrid.uninstall()`` removes both.
"""
from ...gloo.groups import ensure_process_group
from ...registry.component import Component
from ...registry.paddle_registries import add_meta_optimizer, add_pass
from ...common.layout_check import LayoutMismatchError
from .pir_repair import repair_custom_vector_ops, translate_with_repair
from .plan import FuseAllreduceConfig, FusedLayout, GradSlot, Group, layout_fingerprint, plan_groups
from .rewrite import PASS_NAME, FuseAllreducePass, apply_fuse_allreduce, broadcast_parameters
from .runner import StaticRunner, check_layout_across_ranks, use_pir_path

__all__ = ["FuseAllreduceConfig", "FusedLayout", "GradSlot", "Group", "plan_groups", "layout_fingerprint",
           "apply_fuse_allreduce", "broadcast_parameters", "FuseAllreducePass", "PASS_NAME", "StaticRunner",
           "check_layout_across_ranks", "ensure_process_group", "use_pir_path", "repair_custom_vector_ops",
           "translate_with_repair", "LayoutMismatchError", "COMPONENT"]


def apply(config, patcher) -> None:
    """Fleet applies ``FusedAllreduceOptimizer`` (carrying ``config``); Paddle knows the pass
    ``ph_fuse_allreduce``."""
    from . import meta_optimizer

    add_meta_optimizer(patcher, meta_optimizer.for_config(config))
    add_pass(patcher, FuseAllreducePass)


COMPONENT = Component("fused_allreduce", ("3.2.", "3.3."), "fused_allreduce", apply)
