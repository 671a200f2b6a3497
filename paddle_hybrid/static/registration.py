"""The static features made known to Paddle: meta optimizers to fleet, passes to Paddle's registry.

The component ``registration``; every change goes through its patcher, so
``paddle_hybrid.uninstall()`` removes exactly what it added.

* **Meta optimizers.**  Fleet's ``meta_optimizer_factory`` builds its list of meta optimizer
  names once, at import (``from ..meta_optimizers import *``); adding a class to
  ``fleet.meta_optimizers`` alone is ignored.  Each class is therefore set on the factory module
  and appended to its ``meta_optimizer_names`` (where fleet applies it outermost, around the
  upstream ones).  A class must implement ``_can_apply``, ``_disable_strategy`` and
  ``minimize_impl``.
* **Passes.**  Each pass class is registered with Paddle's own ``register_pass(name)``, which
  writes ``PassBase._REGISTERED_PASSES[name]``; undo removes that entry, after which
  ``paddle.distributed.passes.new_pass(name)`` fails again.

Both lists hold ``"module.path:ClassName"``; a name Paddle already has is refused, never replaced.
"""
from __future__ import annotations

import functools
import importlib

from ..registry.component import Component

__all__ = ["META_OPTIMIZERS", "PASSES", "COMPONENT", "apply", "registered_names", "registered_passes"]

META_OPTIMIZERS: list[str] = [
    "paddle_hybrid.static.fused_allreduce.meta_optimizer:FusedAllreduceOptimizer",
    "paddle_hybrid.static.send_wait.meta_optimizer:PipelineSendWaitOptimizer",
]

PASSES: list[str] = [
    "paddle_hybrid.static.fused_allreduce.rewrite:FuseAllreducePass",
    "paddle_hybrid.static.send_wait.rewrite:SendWaitPass",
]



def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _check_meta_optimizer(cls) -> str:
    name = cls.__name__
    if not name.endswith("Optimizer"):
        raise ValueError(f"paddle_hybrid: meta optimizer class {name} must end in 'Optimizer'.")
    for method in ("_can_apply", "_disable_strategy", "minimize_impl"):
        if method not in vars(cls) and not any(method in vars(b) for b in cls.__mro__[1:-1]
                                               if b.__name__ != "MetaOptimizerBase"):
            raise TypeError(f"paddle_hybrid: meta optimizer {name} does not implement {method}.")
    return name


def apply(config, patcher) -> None:
    """Register every meta optimizer with fleet and every pass with Paddle (undone through
    ``patcher``)."""
    _register_meta_optimizers(patcher)
    _register_passes(patcher)


def _register_meta_optimizers(patcher) -> None:
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    for spec in META_OPTIMIZERS:
        cls = _load(spec)
        name = _check_meta_optimizer(cls)
        if name in factory.meta_optimizer_names or hasattr(factory, name):
            raise RuntimeError(
                f"paddle_hybrid: fleet already has a meta optimizer named {name}; refusing to replace it.")
        patcher.set(factory, name, cls)
        factory.meta_optimizer_names.append(name)
        patcher.on_revert(functools.partial(_unlist, factory.meta_optimizer_names, name),
                          f"meta_optimizer_names: {name}")


def _register_passes(patcher) -> None:
    from paddle.distributed.passes import pass_base

    registry = patcher.require(pass_base.PassBase, "_REGISTERED_PASSES", "paddle.distributed.passes.PassBase")
    for spec in PASSES:
        cls = _load(spec)
        if not (isinstance(cls, type) and issubclass(cls, pass_base.PassBase)) or not cls.name:
            raise TypeError(f"paddle_hybrid: {spec} is not a PassBase subclass with a name.")
        if cls.name in registry:
            raise RuntimeError(f"paddle_hybrid: Paddle already has a pass named {cls.name}; refusing to replace it.")
        pass_base.register_pass(cls.name)(cls)
        patcher.on_revert(functools.partial(_unregister, registry, cls.name, cls), f"registered pass: {cls.name}")
        if registry.get(cls.name) is not cls:
            raise RuntimeError(f"paddle_hybrid: register_pass({cls.name!r}) did not register {cls.__name__} in "
                               "PassBase._REGISTERED_PASSES; this Paddle's pass registry differs from 3.3's.")


def _unlist(names: list, name: str) -> None:
    if name in names:
        names.remove(name)


def _unregister(registry: dict, name: str, cls) -> None:
    if registry.get(name) is cls:
        del registry[name]


def registered_names() -> list[str]:
    """Names of the meta optimizers this component added to fleet (none when not installed)."""
    return [name for _, name in COMPONENT.patched()]


def registered_passes() -> list[str]:
    """Names of the passes this component registered with Paddle (none when not installed)."""
    from paddle.distributed.passes.pass_base import PassBase

    if not COMPONENT.is_active():
        return []
    classes = [_load(spec) for spec in PASSES]
    return [cls.name for cls in classes if PassBase._REGISTERED_PASSES.get(cls.name) is cls]


COMPONENT = Component("registration", ("3.2.", "3.3."), "register_meta_optimizers", apply)
