"""Fixes of fleet defects that give wrong numbers on every device (GPU included).

============================  ===============================================
fix                           what it fixes (details in the module docstring)
============================  ===============================================
:mod:`.shared_weight_norm`    global-norm clipping counts a weight shared
                              between pipeline stages once per stage
:mod:`.no_pipeline_dp`        a one-stage ``PipelineLayer`` under pure data
                              parallelism never averages its gradients
============================  ===============================================

When: ``PluginConfig.fleet_fixes`` (``PADDLE_HYBRID_FLEET_FIXES``, default on).  Written
against Paddle 3.3.x; on another version they are skipped with a warning.
"""
from __future__ import annotations

import warnings

from ..patching import Patcher, PatchSignatureError, describe_versions, version_supported

__all__ = ["install", "uninstall", "is_active", "FIXES", "SUPPORTED_PADDLE", "PatchSignatureError"]

SUPPORTED_PADDLE = ("3.3.",)
FIXES = ["shared_weight_norm", "no_pipeline_dp"]

_patcher = Patcher("paddle_hybrid.fleet_fixes", "PADDLE_HYBRID_FLEET_FIXES=0 (PluginConfig(fleet_fixes=False))")


def install(config) -> None:
    if not config.fleet_fixes or _patcher.applied:
        return
    import paddle

    if not version_supported(paddle.__version__, SUPPORTED_PADDLE):
        warnings.warn(f"paddle_hybrid.fleet_fixes: written for Paddle {describe_versions(SUPPORTED_PADDLE)}, "
                      f"found {paddle.__version__}; not installed (PADDLE_HYBRID_FLEET_FIXES=0 silences this).",
                      RuntimeWarning, stacklevel=2)
        return
    _patcher.apply_modules(__name__, FIXES)


def uninstall() -> None:
    _patcher.revert()


def is_active() -> bool:
    return _patcher.applied
