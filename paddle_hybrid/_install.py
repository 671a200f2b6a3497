"""The one registry of what the plugin changes in Paddle: install all or none, undo all.

Every component that touches Paddle is a module listed in ``COMPONENTS`` with

* ``VERIFIED_PADDLE``: the Paddle version prefixes every change of it was checked on;
* ``SWITCH``: how a user turns it off (quoted in messages);
* ``skip_reason(config)``: why this config does not want it (switched off, not needed), or None;
* ``apply(config, patcher)``: make every change through the :class:`~.patching.Patcher` it is
  given (``set`` for an attribute, ``on_revert`` for anything else), or raise
  :class:`ComponentSkipped` when it finds at run time that it cannot apply; it may return a
  note (what it did, when that is not an attribute), which :func:`report` prints.

Policy:

* on a Paddle version a component was not verified on, it is skipped with a warning naming the
  version and the switch that forces it (``PADDLE_HYBRID_FORCE=<name>[,<name>...]`` or ``all``);
  ``import paddle_hybrid`` never fails for that reason;
* install is all or none: if a component raises, everything installed so far is undone and one
  :class:`InstallError` names the component, the cause and its switch;
* :func:`uninstall` restores every original, newest first; the :func:`install` after it reads
  the environment again;
* two components may wrap one attribute, and either may be uninstalled first: the other's
  wrapper keeps working (:mod:`paddle_hybrid.patching`, "Two owners of one attribute");
* the device rule (:mod:`paddle_hybrid.device_rule`): a path that has never run on this build's
  accelerator is off until opted in; :func:`report` lists each one.

:func:`report` says what is active and why the rest is not; :func:`patches` lists every
replaced attribute with its original, its replacement and the versions it was verified on.
"""
from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings

from .config import PluginConfig
from .patching import Patcher, describe_versions, version_supported

__all__ = ["COMPONENTS", "install", "uninstall", "installed_components", "current_config", "report",
           "patches", "component_state", "install_component", "uninstall_component", "is_verified",
           "InstallError", "ComponentSkipped"]

# Module paths, installed in this order and uninstalled in reverse.
COMPONENTS: list[str] = [
    "paddle_hybrid.cpu_blas",  # first: MKL reads its CPU setting at the first BLAS call
    "paddle_hybrid.registration",
    "paddle_hybrid.reshard",
    "paddle_hybrid.cpu",
    "paddle_hybrid.expert_parallel",
    "paddle_hybrid.fleet_fixes",
    "paddle_hybrid.paddleformers_fixes",
    "paddle_hybrid.static_pipeline",
    "paddle_hybrid.auto_parallel_cpu",
    "paddle_hybrid.grad_buckets",
    "paddle_hybrid.cuda_graph.pipeline",
    "paddle_hybrid.timeline",
]


class InstallError(RuntimeError):
    """A component failed to install; nothing of the plugin is installed."""


class ComponentSkipped(Exception):
    """Raised by a component's ``apply`` when it finds it cannot apply here (before any change)."""


@dataclasses.dataclass
class ComponentState:
    """What the registry knows of one component after :func:`install`."""

    path: str
    status: str  # "active" | "off" (not wanted by the config) | "skipped" (cannot or may not apply)
    reason: str = ""
    patcher: Patcher | None = None
    verified: tuple = ()
    config: PluginConfig | None = None
    """The config it was installed with (``install_component`` may give one its own)."""


_lock = threading.RLock()
_states: dict[str, ComponentState] = {}  # path -> state, in install order
_config: PluginConfig | None = None


def short_name(path: str) -> str:
    """``paddle_hybrid.cuda_graph.pipeline`` -> ``cuda_graph.pipeline`` (the name
    ``PADDLE_HYBRID_FORCE`` takes)."""
    return path.removeprefix("paddle_hybrid.")


def _resolve(name: str) -> str:
    path = name if name.startswith("paddle_hybrid.") else "paddle_hybrid." + name
    if path not in COMPONENTS:
        raise ValueError(f"paddle_hybrid: no component {name!r}; components are "
                         f"{[short_name(p) for p in COMPONENTS]}.")
    return path


def is_verified(path: str, config: PluginConfig | None = None) -> tuple[bool, str]:
    """``(ok, message)``: may component ``path`` change this Paddle?  ``message`` says why not,
    naming the version and the switch that forces it."""
    import paddle

    module = importlib.import_module(path)
    config = config or _config or PluginConfig.from_env()
    forced = "all" in config.force_unverified or short_name(path) in config.force_unverified
    if forced or version_supported(paddle.__version__, module.VERIFIED_PADDLE):
        return True, ""
    return False, (f"{path}: verified on Paddle {describe_versions(module.VERIFIED_PADDLE)}, this is "
                   f"{paddle.__version__}; skipped. Set PADDLE_HYBRID_FORCE={short_name(path)} to install it "
                   f"anyway, or {module.SWITCH} to silence this.")


def _install_one(path: str, config: PluginConfig) -> ComponentState:
    """Phases: wanted? verified? apply (undone on any failure)."""
    module = importlib.import_module(path)
    verified = tuple(module.VERIFIED_PADDLE)
    reason = module.skip_reason(config)
    if reason:
        return ComponentState(path, "off", reason, verified=verified, config=config)
    ok, message = is_verified(path, config)
    if not ok:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return ComponentState(path, "skipped", message, verified=verified, config=config)
    patcher = Patcher(path, module.SWITCH)
    try:
        note = module.apply(config, patcher)
    except ComponentSkipped as skipped:
        patcher.revert()
        message = f"{path}: {skipped} ({module.SWITCH} silences this)"
        warnings.warn(message, getattr(skipped, "category", RuntimeWarning), stacklevel=3)
        return ComponentState(path, "skipped", message, verified=verified, config=config)
    except BaseException:
        patcher.revert()
        raise
    return ComponentState(path, "active", note or "", patcher, verified, config)


def _undo(state: ComponentState) -> None:
    if state.patcher is not None:
        state.patcher.revert()


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
        config = config if config is not None else PluginConfig.from_env()
        _check_forced_names(config)
        _config = config
        for path in COMPONENTS:
            if path in _states:  # installed on its own before (install_component, timeline.enable)
                continue
            try:
                _states[path] = _install_one(path, config)
            except BaseException as exc:
                switch = getattr(importlib.import_module(path), "SWITCH", "its switch")
                _rollback()
                raise InstallError(
                    f"paddle_hybrid: installing {path} failed: {exc}. Nothing of the plugin is installed "
                    f"(every change was undone). {switch} turns this component off.") from exc
        _reorder()
        return config


def _check_forced_names(config: PluginConfig) -> None:
    known = {short_name(p) for p in COMPONENTS} | {"all"}
    unknown = [n for n in config.force_unverified if n not in known]
    if unknown:
        raise ValueError(f"paddle_hybrid: PADDLE_HYBRID_FORCE (PluginConfig.force_unverified) names "
                         f"{unknown}, which are not components; use some of {sorted(known)}.")


def _undo_all() -> list[str]:
    """Undo every installed component, newest first, each even if an earlier undo failed;
    returns the failures."""
    global _config
    failures = []
    while _states:
        _, state = _states.popitem()
        try:
            _undo(state)
        except Exception as exc:  # keep undoing the rest
            failures.append(f"{state.path}: {exc!r}")
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


def install_component(name: str, config: PluginConfig | None = None) -> ComponentState:
    """(Re)install one component with ``config`` (the installed config by default): for tests and
    for turning one feature off and on without touching the others."""
    path = _resolve(name)
    with _lock:
        uninstall_component(path)
        state = _install_one(path, config or _config or PluginConfig.from_env())
        _states[path] = state
        _reorder()
        return state


def uninstall_component(name: str) -> None:
    path = _resolve(name)
    with _lock:
        state = _states.pop(path, None)
        if state is not None:
            _undo(state)


def _reorder() -> None:
    ordered = {p: _states[p] for p in COMPONENTS if p in _states}
    _states.clear()
    _states.update(ordered)


def component_state(name: str) -> ComponentState | None:
    return _states.get(_resolve(name))


def installed_components() -> list[str]:
    """Paths of the active components, in install order."""
    return [p for p, s in _states.items() if s.status == "active"]


def current_config() -> PluginConfig | None:
    return _config


def patches() -> list[dict]:
    """Every Paddle attribute the active components replaced: component, owner, name,
    original, replacement, verified versions."""
    out = []
    for state in _states.values():
        if state.patcher is None:
            continue
        for owner, name, original, replacement in state.patcher.changes():
            out.append({"component": state.path, "owner": getattr(owner, "__name__", repr(owner)),
                        "name": name, "original": original, "replacement": replacement,
                        "verified": describe_versions(state.verified)})
    return out


def report() -> str:
    """One line per component: active (with how many changes) or why not; then the device rule:
    one line per path that has never run on an accelerator, on or off on this build and why."""
    import paddle

    from .device import accelerator_build
    from .device_rule import describe

    accelerator = accelerator_build()
    lines = [f"paddle_hybrid on Paddle {paddle.__version__} ({accelerator or 'CPU-only'} build):"]
    for path in COMPONENTS:
        state = _states.get(path)
        if state is None:
            lines.append(f"  {short_name(path):22s} not installed (paddle_hybrid.install() not called)")
        elif state.status == "active":
            n = len(state.patcher.changes()) if state.patcher else 0
            note = f"; {state.reason}" if state.reason else ""
            lines.append(f"  {short_name(path):22s} active: {n} Paddle attributes replaced "
                         f"(verified on Paddle {describe_versions(state.verified)}, on CPU){note}")
        else:
            lines.append(f"  {short_name(path):22s} {state.status}: {state.reason}")
    config = _config or PluginConfig.from_env()
    where = f"never run on {accelerator}" if accelerator else "run and tested on CPU"
    lines.append(f"device rule (paths written for accelerators, {where}):")
    lines.extend("  " + line for line in describe(config, accelerator))
    return "\n".join(lines)
