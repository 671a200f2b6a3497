"""Import paths that moved, kept working with a ``DeprecationWarning`` naming the new one.

A finder on ``sys.meta_path`` answers an old dotted name (``paddle_hybrid.send_wait``,
``paddle_hybrid.dygraph.cpu.gloo_errors``) with the module at its new place: the same module
object, so ``from <old> import X`` gives the very ``X`` of the new module.  :data:`MOVED` maps
old prefixes to new ones; a name below an old prefix maps the same way
(``paddle_hybrid.cpu.groups`` -> ``paddle_hybrid.dygraph.cpu.groups`` -> ``paddle_hybrid.gloo.groups``),
following later moves until a name exists.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "new_name", "install_finder", "moved_attribute"]

MOVED = {
    # the gloo backend became a layer of its own (paddle_hybrid.gloo)
    "paddle_hybrid.common.gloo_timeout": "paddle_hybrid.gloo.context_timeout",
    "paddle_hybrid.dygraph.paddleformers_fixes.import_hook": "paddle_hybrid.common.import_hook",
    "paddle_hybrid.common.prefix_store": "paddle_hybrid.gloo.prefix_store",
    "paddle_hybrid.common.sockets": "paddle_hybrid.gloo.sockets",
    "paddle_hybrid.dygraph.cpu.groups": "paddle_hybrid.gloo.groups",
    "paddle_hybrid.dygraph.cpu.gloo_deadline": "paddle_hybrid.gloo.deadline",
    "paddle_hybrid.dygraph.cpu.gloo_errors": "paddle_hybrid.gloo.errors",
    "paddle_hybrid.dygraph.cpu.tcp_store": "paddle_hybrid.gloo.tcp_store",
    "paddle_hybrid.dygraph.cpu.collectives": "paddle_hybrid.gloo.collectives",
    "paddle_hybrid.dygraph.expert_parallel.all_to_all": "paddle_hybrid.gloo.all_to_all",
    "paddle_hybrid.static.static_pipeline.rings": "paddle_hybrid.gloo.rings",
    # the registry's upper layer (listing and installing) above the features
    "paddle_hybrid.registry.catalog": "paddle_hybrid.catalog",
    "paddle_hybrid.registry.install": "paddle_hybrid.catalog.install",
    "paddle_hybrid.registry.env_at_start": "paddle_hybrid.launch.env_at_start",
    # the component that registered both static meta optimizers is each feature's own now
    "paddle_hybrid.static.registration": "paddle_hybrid.registry.paddle_registries",
    # the features moved under dygraph/ and static/ (the restructure before)
    "paddle_hybrid.cpu": "paddle_hybrid.dygraph.cpu",
    "paddle_hybrid.cuda_graph": "paddle_hybrid.dygraph.cuda_graph",
    "paddle_hybrid.expert_parallel": "paddle_hybrid.dygraph.expert_parallel",
    "paddle_hybrid.fleet_fixes": "paddle_hybrid.dygraph.fleet_fixes",
    "paddle_hybrid.grad_buckets": "paddle_hybrid.dygraph.grad_buckets",
    "paddle_hybrid.paddleformers_fixes": "paddle_hybrid.dygraph.paddleformers_fixes",
    "paddle_hybrid.timeline": "paddle_hybrid.dygraph.timeline",
    "paddle_hybrid.auto_parallel_cpu": "paddle_hybrid.static.auto_parallel_cpu",
    "paddle_hybrid.fused_allreduce": "paddle_hybrid.static.fused_allreduce",
    "paddle_hybrid.send_wait": "paddle_hybrid.static.send_wait",
    "paddle_hybrid.static_pipeline": "paddle_hybrid.static.static_pipeline",
    "paddle_hybrid.reshard": "paddle_hybrid.static.reshard",
    "paddle_hybrid.registration": "paddle_hybrid.registry.paddle_registries",
    "paddle_hybrid.program_edit": "paddle_hybrid.common.program_edit",
    "paddle_hybrid.grad_tools": "paddle_hybrid.common.grad_tools",
    "paddle_hybrid.layout_check": "paddle_hybrid.common.layout_check",
    "paddle_hybrid.pipeline_chunk": "paddle_hybrid.common.pipeline_chunk",
    "paddle_hybrid.device": "paddle_hybrid.registry.device",
    "paddle_hybrid.patching": "paddle_hybrid.registry.patching",
}


def new_name(old: str) -> str | None:
    """Where the module ``old`` lives now, or None if it did not move."""
    name, moved = old, False
    for _ in range(len(MOVED) + 1):  # each step applies one move; a chain ends well before
        prefix = next((p for p in sorted(MOVED, key=len, reverse=True) if name == p or name.startswith(p + ".")), None)
        if prefix is None:
            return name if moved else None
        name, moved = MOVED[prefix] + name[len(prefix):], True
    raise RuntimeError(f"paddle_hybrid._moved: the moves of {old!r} form a cycle.")


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"paddle_hybrid: {spec.name} moved to {self.new}; import it from there.", DeprecationWarning,
                      stacklevel=6)
        return importlib.import_module(self.new)

    def exec_module(self, module):  # the module is the new one, already executed
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("paddle_hybrid."):
            return None
        new = new_name(fullname)
        if new is None or new == fullname or importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


_FINDER = _MovedFinder()


def install_finder() -> None:
    """Put the finder at the end of ``sys.meta_path`` (once): a name that exists is always found
    by the ordinary finders first."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def moved_attribute(old_module: str, name: str, new_module: str):
    """``name`` of ``new_module``, for an old module's ``__getattr__``: the same object, with a
    ``DeprecationWarning`` naming the new place.  Loaded by name, so a layer below keeps its old
    names without importing the layer they moved up to."""
    warnings.warn(f"paddle_hybrid: {old_module}.{name} moved to {new_module}; import it from there.",
                  DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new_module), name)
