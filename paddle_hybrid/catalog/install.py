"""The one registry of what the plugin changes in Paddle: install all or none, undo all.

Every feature that touches Paddle declares a :class:`~paddle_hybrid.registry.component.Component`;
:mod:`paddle_hybrid.catalog` lists them in install order.  Policy:

* whether a component is wanted is its switch field's answer from
  :func:`paddle_hybrid.registry.gate.decide` (and its own ``not_wanted``, if any); the gate's reason
  is what ``report()`` says of it;
* on a Paddle version a component was not verified on, it is skipped with a warning naming the
  version and the switch that forces it (``PADDLE_HYBRID_FORCE=<name>[,<name>...]`` or ``all``);
  ``import paddle_hybrid`` never fails for that reason;
* install is all or none: if a component raises, everything installed so far is undone and one
  :class:`InstallError` names the component, the cause and its switch;
* :func:`uninstall` restores every original, newest first; the :func:`install` after it reads
  the environment again;
* two components may wrap one attribute, and either may be uninstalled first: the other's
  wrapper keeps working (:mod:`paddle_hybrid.registry.patching`, "Two owners of one attribute").

One component installs and undoes itself (:meth:`Component.install`, :meth:`Component.uninstall`);
this module keeps the order, the config of the whole plugin and the all-or-none rule.
:func:`report` says what is active and why the rest is not, then every gated path of the device
rule; :func:`patches` lists every replaced attribute with its original, its replacement and the
versions it was verified on.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings

from ..config import PluginConfig
from ..registry import gate
from ..registry.component import Component, ComponentSkipped, ComponentState
from ..registry.patching import describe_versions
from . import COMPONENTS

__all__ = ["COMPONENTS", "install", "uninstall", "installed_components", "current_config", "report",
           "patches", "component_state", "install_component", "uninstall_component", "is_verified",
           "InstallError", "ComponentSkipped"]


class InstallError(RuntimeError):
    """A component failed to install; nothing of the plugin is installed."""


_lock = threading.RLock()
_config: PluginConfig | None = None


def _installed() -> list[Component]:
    """Components with a state (installed, off or skipped), in install order."""
    return [c for c in COMPONENTS if c.state is not None]


def _resolve(name) -> Component:
    """A component, given it or its name (``"cpu"``; the old ``"paddle_hybrid.cpu"`` form is
    accepted too)."""
    if isinstance(name, Component):
        return name
    short = name.removeprefix("paddle_hybrid.")
    for component in COMPONENTS:
        if component.name == short:
            return component
    raise ValueError(f"paddle_hybrid: no component {name!r}; components are {[c.name for c in COMPONENTS]}.")


def is_verified(component, config: PluginConfig | None = None) -> tuple[bool, str]:
    """``(ok, message)``: may ``component`` change this Paddle?  ``message`` says why not,
    naming the version and the switch that forces it."""
    return _resolve(component).is_verified(config or _config or PluginConfig.from_env())


def install(config: PluginConfig | None = None) -> PluginConfig:
    """Install every component: all or none (idempotent while installed).

    ``config`` defaults to :meth:`PluginConfig.from_env`, read now.  To change the config of an
    installed plugin, call :func:`uninstall` first.
    """
    global _config
    with _lock:
        if _config is not None:
            if config is not None and config != _config:
                raise RuntimeError("paddle_hybrid is already installed with another config; call "
                                   "paddle_hybrid.uninstall() before installing with a new one.")
            return _config
        config = _with_renamed_components(config if config is not None else PluginConfig.from_env())
        _check_forced_names(config)
        _config = config
        for component in COMPONENTS:
            if component.state is not None:  # installed on its own before (install_component, timeline.enable)
                continue
            try:
                component.install(config)
            except BaseException as exc:
                _rollback()
                raise InstallError(
                    f"paddle_hybrid: installing {component.name} failed: {exc}. Nothing of the plugin is installed "
                    f"(every change was undone). {component.off_switch} turns this component off.") from exc
        return config


RENAMED_COMPONENTS = {"cuda_graph.pipeline": "cuda_graph"}
"""Component names before each took its feature's name (still taken by ``PADDLE_HYBRID_FORCE``)."""


def _with_renamed_components(config: PluginConfig) -> PluginConfig:
    """``config`` with old component names in ``force_unverified`` replaced, with a warning."""
    old = [n for n in config.force_unverified if n in RENAMED_COMPONENTS]
    if not old:
        return config
    warnings.warn(f"paddle_hybrid: the components {old} are named {[RENAMED_COMPONENTS[n] for n in old]} now; "
                  "use the new names in PADDLE_HYBRID_FORCE.", DeprecationWarning, stacklevel=4)
    names = tuple(RENAMED_COMPONENTS.get(n, n) for n in config.force_unverified)
    return dataclasses.replace(config, force_unverified=names)


def _check_forced_names(config: PluginConfig) -> None:
    known = {c.name for c in COMPONENTS} | {"all"}
    unknown = [n for n in config.force_unverified if n not in known]
    if unknown:
        raise ValueError(f"paddle_hybrid: PADDLE_HYBRID_FORCE (PluginConfig.force_unverified) names "
                         f"{unknown}, which are not components; use some of {sorted(known)}.")


def _undo_all() -> list[str]:
    """Undo every installed component, newest first, each even if an earlier undo failed;
    returns the failures."""
    global _config
    failures = []
    for component in reversed(_installed()):
        try:
            component.uninstall()
        except Exception as exc:  # keep undoing the rest
            failures.append(f"{component.name}: {exc!r}")
    _config = None
    return failures


def _rollback() -> None:
    """After a failed install: undo, and warn about what could not be undone (the install
    error is the one raised)."""
    failures = _undo_all()
    if failures:
        warnings.warn("paddle_hybrid: could not undo " + "; ".join(failures), RuntimeWarning, stacklevel=3)


def uninstall() -> None:
    """Undo every installed component, newest first; the next :func:`install` reads the
    environment again."""
    with _lock:
        failures = _undo_all()
        if failures:
            raise RuntimeError("paddle_hybrid.uninstall: " + "; ".join(failures))


def install_component(name, config: PluginConfig | None = None) -> ComponentState:
    """(Re)install one component with ``config`` (the installed config by default): for tests and
    for turning one feature off and on without touching the others."""
    component = _resolve(name)
    with _lock:
        return component.install(config or _config or PluginConfig.from_env())


def uninstall_component(name) -> None:
    """Undo one component; while the plugin is installed it stays listed, off, with the plugin's
    config (what the timeline's ``enable`` installs it again with)."""
    component = _resolve(name)
    with _lock:
        component.uninstall()
        if _config is not None:
            component.state = ComponentState("off", "uninstalled on its own (paddle_hybrid.uninstall_component)",
                                             config=_config)


def component_state(name) -> ComponentState | None:
    return _resolve(name).state


def installed_components() -> list[str]:
    """Names of the active components, in install order."""
    return [c.name for c in _installed() if c.is_active()]


def current_config() -> PluginConfig | None:
    return _config


def patches() -> list[dict]:
    """Every Paddle attribute the active components replaced: component, owner, name,
    original, replacement, verified versions."""
    out = []
    for component in _installed():
        if component.patcher is None:
            continue
        for owner, name, original, replacement in component.patcher.changes():
            out.append({"component": component.name, "owner": getattr(owner, "__name__", repr(owner)),
                        "name": name, "original": original, "replacement": replacement,
                        "verified": describe_versions(component.verified_paddle)})
    return out


def report() -> str:
    """One line per component: active (with how many changes) or why not; then the device rule:
    one line per gated path, on or off on this build and why."""
    import paddle

    from ..registry.device import accelerator_build

    accelerator = accelerator_build()
    lines = [f"paddle_hybrid on Paddle {paddle.__version__} ({accelerator or 'CPU-only'} build):"]
    for component in COMPONENTS:
        state = component.state
        if state is None:
            lines.append(f"  {component.name:22s} not installed (paddle_hybrid.install() not called)")
        elif state.status == "active":
            n = len(state.patcher.changes()) if state.patcher else 0
            note = f"; {state.reason}" if state.reason else ""
            lines.append(f"  {component.name:22s} active: {n} Paddle attributes replaced "
                         f"(verified on Paddle {describe_versions(component.verified_paddle)}, on CPU){note}")
        else:
            lines.append(f"  {component.name:22s} {state.status}: {state.reason}")
    config = _config or PluginConfig.from_env()
    where = f"never run on {accelerator}" if accelerator else "run and tested on CPU"
    lines.append(f"device rule (paths not run on every device; this build: {where}):")
    lines.extend("  " + line for line in gate.describe(config, accelerator))
    return "\n".join(lines)
