"""Installing and uninstalling the plugin's changes to Paddle, in one place.

Every component that touches Paddle (fleet registration, patches for CPU/gloo,
reshard without per-insert sync, ...) is a module with ``install(config)`` and
``uninstall()`` listed in ``COMPONENTS``.  ``import paddle_hybrid`` calls
:func:`install` once; :func:`uninstall` undoes every component in reverse order.
"""
from __future__ import annotations

import importlib
import threading

from .config import PluginConfig

__all__ = ["COMPONENTS", "install", "uninstall", "installed_components", "current_config"]

# Module paths, installed in this order and uninstalled in reverse.
COMPONENTS: list[str] = [
    "paddle_hybrid.meta_optimizers",
    "paddle_hybrid.passes.reshard",
    "paddle_hybrid.cpu",
    "paddle_hybrid.fleet_fixes",
    "paddle_hybrid.dygraph",
    "paddle_hybrid.cuda_graph.pipeline",
    "paddle_hybrid.timeline",
]

_lock = threading.RLock()
_installed: list[str] = []
_config: PluginConfig | None = None


def install(config: PluginConfig | None = None) -> PluginConfig:
    """Install every component (idempotent: an installed one is left alone).

    ``config`` defaults to :meth:`PluginConfig.from_env`.  To change the config
    of an installed plugin, call :func:`uninstall` first.
    """
    global _config
    with _lock:
        if config is None:
            config = _config or PluginConfig.from_env()
        elif _installed and config != _config:
            raise RuntimeError(
                "paddle_hybrid is already installed with another config; call "
                "paddle_hybrid.uninstall() before installing with a new one."
            )
        _config = config
        for path in COMPONENTS:
            if path in _installed:
                continue
            importlib.import_module(path).install(config)
            _installed.append(path)
        return config


def uninstall() -> None:
    """Undo every installed component, newest first."""
    with _lock:
        errors = []
        while _installed:
            path = _installed.pop()
            try:
                importlib.import_module(path).uninstall()
            except Exception as exc:  # keep undoing the rest
                errors.append(f"{path}: {exc!r}")
        if errors:
            raise RuntimeError("paddle_hybrid.uninstall: " + "; ".join(errors))


def installed_components() -> list[str]:
    return list(_installed)


def current_config() -> PluginConfig | None:
    return _config
