"""A feature's declaration to the registry: :class:`Component`.

Each feature package declares one ``COMPONENT`` (its name as ``report()`` prints it, the Paddle
versions its changes were verified on, the :class:`~paddle_hybrid.config.PluginConfig` field
that switches it, and its ``apply``); :mod:`.catalog` lists them in install order and
:mod:`.install` installs them.  How the switch field is read (a plain switch, ``auto/on/off``,
the device rule's tri-state) is the field's, decided in one place, :func:`.gate.decide`.

The registry hands each component its own state (:attr:`Component.state`): whether it is
active, the config it was installed with, its :class:`~.patching.Patcher`.  A feature asks its
own ``COMPONENT`` (``COMPONENT.is_active()``, ``COMPONENT.config``), never the registry.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .patching import Patcher

__all__ = ["Component", "ComponentState", "ComponentSkipped"]


class ComponentSkipped(Exception):
    """Raised by a component's ``apply`` when it finds, before any change, that it cannot apply
    here; the registry warns (``category``, RuntimeWarning by default) and goes on."""


@dataclasses.dataclass
class ComponentState:
    """What the registry knows of one component after :func:`~.install.install`."""

    status: str  # "active" | "off" (not wanted by the config) | "skipped" (cannot or may not apply)
    reason: str = ""
    """Why it is off or skipped; for an active component, the note its ``apply`` returned."""
    patcher: Patcher | None = None
    config: object = None
    """The :class:`~paddle_hybrid.config.PluginConfig` it was installed with."""


@dataclasses.dataclass(eq=False)
class Component:
    """One feature as the registry sees it."""

    name: str
    """As ``report()`` prints it and ``PADDLE_HYBRID_FORCE`` takes it (``"cpu"``)."""
    verified_paddle: tuple
    """Paddle version prefixes every change of it was checked on (``("3.2.", "3.3.")``)."""
    switch: str
    """The ``PluginConfig`` field that turns it on and off; :func:`.gate.decide` reads it."""
    apply: Callable
    """``apply(config, patcher)``: make every change through ``patcher`` (``set`` for an
    attribute, ``answer`` for a device answer, ``on_revert`` for anything else), or raise
    :class:`ComponentSkipped`; may return a note for ``report()``."""
    not_wanted: Callable | None = None
    """``not_wanted(config) -> reason | None``: why this machine or config does not want it although
    its switch is on (``cpu_blas``: not an AMD CPU with an MKL that listens)."""
    off_reason: str = ""
    """What ``report()`` says when its switch is off, if not the gate's words."""
    state: ComponentState | None = dataclasses.field(default=None, repr=False)
    """Set by the registry: None until :func:`~.install.install` reached it."""
    registry: object = dataclasses.field(default=None, repr=False)
    """The registry that lists it (:mod:`.install`, set when that module loads): what a feature
    turning itself on or off calls (:meth:`reinstall`, :meth:`remove`) without importing it."""

    @property
    def off_switch(self) -> str:
        """How a user turns it off, quoted in messages."""
        from .gate import off_switch

        return off_switch(self.switch)

    def is_active(self) -> bool:
        return self.state is not None and self.state.status == "active"

    @property
    def patcher(self) -> Patcher | None:
        """Its patcher while active, else None."""
        return self.state.patcher if self.is_active() else None

    @property
    def config(self):
        """The config it was installed with, else None."""
        return self.state.config if self.state is not None else None

    def reinstall(self, config) -> ComponentState:
        """Install this component again with ``config``, on its own (the timeline's ``enable``)."""
        return self.registry.install_component(self, config)

    def remove(self) -> None:
        """Undo this component, on its own (the timeline's ``disable``)."""
        self.registry.uninstall_component(self)

    def patched(self) -> list:
        """``(owner, attribute name)`` of every Paddle attribute it replaced (none when inactive)."""
        patcher = self.patcher
        return patcher.patched() if patcher is not None else []
