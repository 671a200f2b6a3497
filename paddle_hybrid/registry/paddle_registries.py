"""Adding a class to one of Paddle's own registries through a component's patcher, so the
component's undo removes exactly what it added.

* **Fleet's meta optimizers** (:func:`add_meta_optimizer`).  Fleet's ``meta_optimizer_factory``
  builds its list of meta optimizer names once, at import (``from ..meta_optimizers import *``);
  adding a class to ``fleet.meta_optimizers`` alone is ignored.  The class is therefore set on the
  factory module and appended to its ``meta_optimizer_names`` (where fleet applies it outermost,
  around the upstream ones).  It must implement ``_can_apply``, ``_disable_strategy`` and
  ``minimize_impl``.
* **Paddle's passes** (:func:`add_pass`).  The class is registered with Paddle's own
  ``register_pass(name)``, which writes ``PassBase._REGISTERED_PASSES[name]``; undo removes that
  entry, after which ``paddle.distributed.passes.new_pass(name)`` fails again.

A name Paddle already has is refused, never replaced.
"""
from __future__ import annotations

import functools

__all__ = ["add_meta_optimizer", "add_pass"]


def _check_meta_optimizer(cls) -> str:
    name = cls.__name__
    if not name.endswith("Optimizer"):
        raise ValueError(f"paddle_hybrid: meta optimizer class {name} must end in 'Optimizer'.")
    for method in ("_can_apply", "_disable_strategy", "minimize_impl"):
        if method not in vars(cls) and not any(method in vars(b) for b in cls.__mro__[1:-1]
                                               if b.__name__ != "MetaOptimizerBase"):
            raise TypeError(f"paddle_hybrid: meta optimizer {name} does not implement {method}.")
    return name


def add_meta_optimizer(patcher, cls) -> None:
    """Make fleet apply the meta optimizer ``cls`` (undone through ``patcher``)."""
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    name = _check_meta_optimizer(cls)
    if name in factory.meta_optimizer_names or hasattr(factory, name):
        raise RuntimeError(f"paddle_hybrid: fleet already has a meta optimizer named {name}; refusing to replace it.")
    patcher.set(factory, name, cls)
    factory.meta_optimizer_names.append(name)
    patcher.on_revert(functools.partial(_unlist, factory.meta_optimizer_names, name), f"meta_optimizer_names: {name}")


def add_pass(patcher, cls) -> None:
    """Register the pass class ``cls`` under its ``name`` with Paddle (undone through ``patcher``)."""
    from paddle.distributed.passes import pass_base

    registry = patcher.require(pass_base.PassBase, "_REGISTERED_PASSES", "paddle.distributed.passes.PassBase")
    if not (isinstance(cls, type) and issubclass(cls, pass_base.PassBase)) or not cls.name:
        raise TypeError(f"paddle_hybrid: {cls!r} is not a PassBase subclass with a name.")
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
