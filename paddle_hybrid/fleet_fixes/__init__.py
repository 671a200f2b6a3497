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

import importlib
import warnings

from ..patching import Patcher, PatchSignatureError

__all__ = ["install", "uninstall", "is_active", "FIXES", "SUPPORTED_PADDLE", "PatchSignatureError"]

SUPPORTED_PADDLE = ("3.3.",)
FIXES = ["shared_weight_norm", "no_pipeline_dp"]

_patcher = Patcher("paddle_hybrid.fleet_fixes", "PADDLE_HYBRID_FLEET_FIXES=0 (PluginConfig(fleet_fixes=False))")


def install(config) -> None:
    if not config.fleet_fixes or _patcher.applied:
        return
    import paddle

    if not paddle.__version__.startswith(SUPPORTED_PADDLE):
        warnings.warn(f"paddle_hybrid.fleet_fixes: written for Paddle {'/'.join(v + 'x' for v in SUPPORTED_PADDLE)}, "
                      f"found {paddle.__version__}; not installed (PADDLE_HYBRID_FLEET_FIXES=0 silences this).",
                      RuntimeWarning, stacklevel=2)
        return
    try:
        for name in FIXES:
            importlib.import_module(f"{__name__}.{name}").apply(_patcher)
    except BaseException:
        _patcher.revert()
        raise


def uninstall() -> None:
    _patcher.revert()


def is_active() -> bool:
    return _patcher.applied
