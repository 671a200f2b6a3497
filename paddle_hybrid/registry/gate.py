"""The one gate: is a switch of the plugin on, on this build, and why.

Every on/off question of the plugin is a :class:`~paddle_hybrid.config.PluginConfig` field,
and :func:`decide` answers it, for a whole component (the registry asks for each one's switch)
and for a path inside one (a meta optimizer's ``_can_apply``, the CUDA-graph backend choice).
A field is one of four kinds:

* a **switch** (``bool``): on unless False;
* **auto / on / off** (kind ``"auto_on_off"``): code written and run for CPU over
  gloo.  ``"auto"`` is on on a build with no accelerator and off on a CUDA, XPU or custom-device
  build (it never ran there) unless ``allow_unrun``; ``"on"`` everywhere (each replacement still
  hands non-gloo groups and device tensors to Paddle); ``"off"`` never;
* **tri-state** (kind ``"unrun"``): paths written for accelerators and executed only on CPU.
  ``None`` (the default) is on where it has run, a build with no accelerator, and off on an
  accelerator build unless ``allow_unrun``; ``True`` opts in everywhere; ``False`` is off;
* an **opt-in flag** (kind ``"opt_in"``): off unless set, on every build; never run anywhere.
  ``allow_unrun`` does not set it: it changes one of Paddle's own settings, not a path of the
  plugin.

This is the device rule (README, "The device rule"): a path is on by default only on a device
where it has executed and been tested.  ``PluginConfig.allow_unrun``
(``PADDLE_HYBRID_ALLOW_UNRUN=1``) opts in to every auto/on/off and tri-state path at once; an
explicit off wins over it.  :func:`describe` gives ``report()`` one line per gated path.
"""
from __future__ import annotations

import dataclasses

from ..config import ENVIRONMENT, fields_of_kind, kind_of
from . import device

__all__ = ["GatedPath", "GATED", "GATED_KINDS", "Decision", "decide", "describe", "off_switch", "opt_in_hint"]


@dataclasses.dataclass(frozen=True)
class GatedPath:
    """A field whose default depends on the build: code that has not run everywhere."""

    field: str
    kind: str
    """``"unrun"`` (tri-state), ``"auto_on_off"`` or ``"opt_in"``."""


GATED_KINDS = ("unrun", "auto_on_off", "opt_in")

# Read from the fields' declarations (paddle_hybrid.config.setting): what each path is, is said
# under its field.
GATED: dict[str, GatedPath] = {name: GatedPath(name, kind_of(name)) for name in fields_of_kind(*GATED_KINDS)}


@dataclasses.dataclass(frozen=True)
class Decision:
    on: bool
    reason: str
    """Why, for ``report()`` and skip messages (empty when on where it has run)."""


def _env(field: str) -> str:
    return ENVIRONMENT[field]


def off_switch(field: str) -> str:
    """How a user turns ``field`` off, for messages."""
    path = GATED.get(field)
    if path is not None and path.kind == "auto_on_off":
        return f"{_env(field)}=off (PluginConfig({field}='off'))"
    if kind_of(field) == "count":
        return f"{_env(field)}=0 (PluginConfig({field}=0))"
    if kind_of(field) == "path":
        return f"{_env(field)} unset (PluginConfig({field}=None))"
    return f"{_env(field)}=0 (PluginConfig({field}=False))"


def opt_in_hint(field: str) -> str:
    if GATED[field].kind == "auto_on_off":
        return f"opt in with {_env(field)}=on (PluginConfig({field}='on')) or PADDLE_HYBRID_ALLOW_UNRUN=1"
    return f"opt in with {_env(field)}=1 (PluginConfig({field}=True)) or PADDLE_HYBRID_ALLOW_UNRUN=1"


def decide(config, field: str, accelerator: str | None = ...) -> Decision:
    """Is ``config.<field>`` on for this build?  ``accelerator`` defaults to
    :func:`~.device.accelerator_build` (tests pass one)."""
    value = getattr(config, field)
    path = GATED.get(field)
    if path is None and kind_of(field) == "count":  # a period: 0 is off
        return Decision(value > 0, "" if value > 0 else f"off ({field}=0)")
    if path is None and kind_of(field) == "path":  # a directory: unset is off
        return Decision(value is not None, "" if value is not None else f"off ({field} not set)")
    if path is None:  # a plain switch
        if not isinstance(value, bool):
            raise TypeError(f"paddle_hybrid.registry.gate: {field!r} is not a switch of PluginConfig.")
        return Decision(value, "" if value else f"switched off ({field}=False)")
    if path.kind == "opt_in":
        if value:
            return Decision(True, "opted in: never run on any device")
        return Decision(False, f"an opt-in, never run on any device ({_env(field)}=1 sets it)")
    if value is False or value == "off":
        return Decision(False, f"switched off ({field}={value!r})")
    if accelerator is ...:
        accelerator = device.accelerator_build()
    if accelerator is None:
        return Decision(True, "")
    if value is True or value == "on":
        return Decision(True, f"opted in ({field}={value!r}): written, never run on {accelerator}")
    if getattr(config, "allow_unrun", False):
        return Decision(True, f"opted in (allow_unrun=True): written, never run on {accelerator}")
    return Decision(False, f"written, never run on {accelerator}: {opt_in_hint(field)}")


def describe(config, accelerator: str | None = ...) -> list[str]:
    """One line per gated path: on or off, and why."""
    if accelerator is ...:
        accelerator = device.accelerator_build()
    lines = []
    for field in GATED:
        decision = decide(config, field, accelerator)
        state = "on" if decision.on else "off"
        lines.append(f"{field:22s} {state}" + (f": {decision.reason}" if decision.reason else ""))
    return lines
