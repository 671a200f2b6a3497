"""Fleet glue: the plugin's meta optimizers and their registration.

Fleet's ``meta_optimizer_factory`` builds its list of meta optimizer names
once, at import (``from ..meta_optimizers import *``); adding a class to
``fleet.meta_optimizers`` alone is ignored.  Registration therefore adds each
class to the factory module's globals and to its ``meta_optimizer_names``
(where fleet applies it outermost, around the upstream ones), through the
registry's patcher, so ``paddle_hybrid.uninstall()`` removes exactly what it added.

A meta optimizer class is listed in ``META_OPTIMIZERS`` as
``"module.path:ClassName"``; it must implement ``_can_apply``,
``_disable_strategy`` and ``minimize_impl``.
"""
from __future__ import annotations

import functools
import importlib

__all__ = ["META_OPTIMIZERS", "skip_reason", "apply", "registered_names", "VERIFIED_PADDLE", "SWITCH"]

# "module:ClassName" of every meta optimizer the plugin registers.
META_OPTIMIZERS: list[str] = [
    "paddle_hybrid.meta_optimizers.fuse_allreduce:FusedAllreduceOptimizer",
    "paddle_hybrid.meta_optimizers.pipeline_send_wait:PipelineSendWaitOptimizer",
]



def _factory():
    from paddle.distributed.fleet.base import meta_optimizer_factory

    return meta_optimizer_factory


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


VERIFIED_PADDLE = ("3.3.",)
SWITCH = "PADDLE_HYBRID_META_OPTIMIZERS=0 (PluginConfig(register_meta_optimizers=False))"


def _check_class(cls) -> str:
    name = cls.__name__
    if not name.endswith("Optimizer"):
        raise ValueError(f"paddle_hybrid: meta optimizer class {name} must end in 'Optimizer'.")
    for method in ("_can_apply", "_disable_strategy", "minimize_impl"):
        if method not in vars(cls) and not any(method in vars(b) for b in cls.__mro__[1:-1]
                                               if b.__name__ != "MetaOptimizerBase"):
            raise TypeError(f"paddle_hybrid: meta optimizer {name} does not implement {method}.")
    return name


def skip_reason(config):
    return None if config.register_meta_optimizers else "switched off (register_meta_optimizers=False)"


def apply(config, patcher) -> None:
    """Add each class to fleet's meta optimizer factory: an attribute of the factory module
    and an entry of its ``meta_optimizer_names`` list (undone through ``patcher``)."""
    factory = _factory()
    for spec in META_OPTIMIZERS:
        cls = _load(spec)
        name = _check_class(cls)
        if name in factory.meta_optimizer_names or hasattr(factory, name):
            raise RuntimeError(
                f"paddle_hybrid: fleet already has a meta optimizer named {name}; refusing to replace it."
            )
        patcher.set(factory, name, cls)
        factory.meta_optimizer_names.append(name)
        patcher.on_revert(functools.partial(_unlist, factory, name), f"meta_optimizer_names: {name}")


def _unlist(factory, name: str) -> None:
    if name in factory.meta_optimizer_names:
        factory.meta_optimizer_names.remove(name)


def registered_names() -> list[str]:
    from .._install import component_state

    state = component_state(__name__)
    if state is None or state.patcher is None:
        return []
    return [name for _, name in state.patcher.patched()]
