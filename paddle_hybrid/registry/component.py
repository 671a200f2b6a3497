"""A feature's declaration: :class:`Component`, and how one component is installed and undone.

Each feature package declares one ``COMPONENT`` (its name as ``report()`` prints it, the Paddle
versions its changes were verified on, the :class:`~paddle_hybrid.config.PluginConfig` field
that switches it, and its ``apply(config, patcher)``).  How the switch field is read (a plain
switch, ``auto/on/off``, the device rule's tri-state) is the field's, decided in one place,
:func:`.gate.decide`.

One component installs itself (:meth:`Component.install`: wanted? verified? apply through a new
:class:`~.patching.Patcher`, undone on any failure) and undoes itself (:meth:`Component.uninstall`)
and keeps its own state (:attr:`Component.state`: active or why not, the config it was installed
with, its patcher).  What lists every component and installs them all or none is the layer above
the features, :mod:`paddle_hybrid.catalog`; a feature that turns itself on or off (the timeline's
``enable``) calls its own ``COMPONENT``, never that layer.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from . import gate
from .patching import Patcher, describe_versions, version_supported

__all__ = ["Component", "ComponentState", "ComponentSkipped"]


class ComponentSkipped(Exception):
    """Raised by a component's ``apply`` when it finds, before any change, that it cannot apply
    here; :meth:`Component.install` warns (``category``, RuntimeWarning by default), marks it
    skipped and the install goes on."""


@dataclasses.dataclass
class ComponentState:
    """What one component is after :meth:`Component.install`."""

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
    """None until :meth:`install` reached it (and again after :meth:`uninstall`)."""

    @property
    def off_switch(self) -> str:
        """How a user turns it off, quoted in messages."""
        return gate.off_switch(self.switch)

    def is_active(self) -> bool:
        return self.state is not None and self.state.status == "active"

    @property
    def patcher(self) -> Patcher | None:
        """Its patcher while active, else None."""
        return self.state.patcher if self.is_active() else None

    @property
    def config(self):
        """The config it was installed with (also when off or skipped), else None."""
        return self.state.config if self.state is not None else None

    def patched(self) -> list:
        """``(owner, attribute name)`` of every Paddle attribute it replaced (none when inactive)."""
        patcher = self.patcher
        return patcher.patched() if patcher is not None else []

    # -- installing -------------------------------------------------------------------------

    def is_verified(self, config) -> tuple[bool, str]:
        """``(ok, message)``: may this component change this Paddle?  ``message`` says why not,
        naming the version and the switch that forces it."""
        import paddle

        forced = "all" in config.force_unverified or self.name in config.force_unverified
        if forced or version_supported(paddle.__version__, self.verified_paddle):
            return True, ""
        return False, (f"{self.name}: verified on Paddle {describe_versions(self.verified_paddle)}, this is "
                       f"{paddle.__version__}; skipped. Set PADDLE_HYBRID_FORCE={self.name} to install it "
                       f"anyway, or {self.off_switch} to silence this.")

    def why_not_wanted(self, config) -> str | None:
        """Why ``config`` does not want this component here, or None."""
        decision = gate.decide(config, self.switch)
        if not decision.on:
            return self.off_reason or decision.reason
        if self.not_wanted is not None:
            return self.not_wanted(config)
        return None

    def install(self, config) -> ComponentState:
        """Install this component with ``config`` (undoing it first if it was installed).
        Phases: wanted? verified? apply (every change undone on any failure, then re-raised)."""
        self.uninstall()
        self.state = self._installed_state(config)
        return self.state

    def _installed_state(self, config) -> ComponentState:
        reason = self.why_not_wanted(config)
        if reason:
            return ComponentState("off", reason, config=config)
        ok, message = self.is_verified(config)
        if not ok:
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return ComponentState("skipped", message, config=config)
        patcher = Patcher(f"paddle_hybrid {self.name}", self.off_switch)
        try:
            note = self.apply(config, patcher)
        except ComponentSkipped as skipped:
            patcher.revert()
            message = f"{self.name}: {skipped} ({self.off_switch} silences this)"
            warnings.warn(message, getattr(skipped, "category", RuntimeWarning), stacklevel=4)
            return ComponentState("skipped", message, config=config)
        except BaseException:
            patcher.revert()
            raise
        return ComponentState("active", note or gate.decide(config, self.switch).reason, patcher, config)

    def uninstall(self) -> None:
        """Undo every change of this component (nothing if it has none); its state is cleared
        first, so a failing undo leaves it uninstalled and raises."""
        state, self.state = self.state, None
        if state is not None and state.patcher is not None:
            state.patcher.revert()
