"""How a component changes Paddle: every change is recorded with its original, checked
before it is made, and undone newest-first as a unit (:class:`Patcher`)."""
from __future__ import annotations

import importlib
import inspect
import threading

__all__ = ["Patcher", "PatchSignatureError", "version_supported", "describe_versions"]

_MISSING = object()


class PatchSignatureError(RuntimeError):
    """A Paddle function a concern patches does not have the expected parameters."""


class Patcher:
    """Records ``(owner, name, original)`` for every attribute a concern replaces.

    Concerns call :meth:`check_params` on everything they will replace *before*
    the first :meth:`set`, so a Paddle that differs is refused before any change;
    :meth:`revert` restores every original, newest first.
    """

    def __init__(self, component: str, off_switch: str):
        """``component`` names who patches in error messages (``"paddle_hybrid.cpu"``);
        ``off_switch`` is the setting that turns the component off, quoted in them."""
        self.component, self.off_switch = component, off_switch
        self._lock = threading.RLock()
        # (owner, name, original, replacement); owner None: ``name`` is an undo callback
        self._saved: list[tuple[object, str, object, object]] = []

    @property
    def applied(self) -> bool:
        return bool(self._saved)

    def patched(self) -> list[tuple[object, str]]:
        """``(owner, name)`` of every replaced attribute, in patch order."""
        return [(owner, name) for owner, name, _, _ in self._saved if owner is not None]

    def changes(self) -> list[tuple[object, str, object, object]]:
        """``(owner, name, original, replacement)`` of every replaced attribute, in patch order."""
        return [entry for entry in self._saved if entry[0] is not None]

    def check_params(self, fn, names, where: str) -> None:
        try:
            got = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            got = None
        if got != list(names):
            raise PatchSignatureError(
                f"{self.component}: {where} has parameters {got}, expected {list(names)}; this Paddle "
                f"differs from the one these patches were written for. Set {self.off_switch} to run "
                "without them."
            )

    def require(self, owner, name: str, where: str):
        """``getattr(owner, name)``, or a clear error naming what this Paddle lacks."""
        if not hasattr(owner, name):
            raise PatchSignatureError(
                f"{self.component}: {where} has no attribute {name!r}; unexpected Paddle. Set "
                f"{self.off_switch} to run without these patches.")
        return getattr(owner, name)

    def set(self, owner, name: str, value) -> None:
        with self._lock:
            if isinstance(owner, type):
                original = owner.__dict__.get(name, _MISSING)
            else:
                original = getattr(owner, name, _MISSING)
            self._saved.append((owner, name, original, value))
            setattr(owner, name, value)

    def on_revert(self, undo, what: str) -> None:
        """Run ``undo()`` at :meth:`revert`, in the same newest-first order as the attribute
        changes: for changes that are not one attribute (a list entry, a hook, a flag)."""
        with self._lock:
            self._saved.append((None, what, undo, None))

    def revert(self) -> None:
        """Undo every change newest first; every undo runs even if one fails, then the first
        failure is raised."""
        failures = []
        with self._lock:
            while self._saved:
                owner, name, original, _ = self._saved.pop()
                try:
                    self._undo(owner, name, original)
                except Exception as exc:  # keep undoing the rest, report below
                    failures.append(f"{name}: {exc!r}")
        if failures:
            raise RuntimeError(f"{self.component}: could not undo " + "; ".join(failures))

    @staticmethod
    def _undo(owner, name, original) -> None:
        if owner is None:
            original()
        elif original is _MISSING:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, original)

    def apply_modules(self, package: str, names) -> None:
        """``<package>.<name>.apply(self)`` for every name, in order; all or none: on any
        error every change made so far is reverted and the error propagates."""
        try:
            for name in names:
                importlib.import_module(f"{package}.{name}").apply(self)
        except BaseException:
            self.revert()
            raise


def version_supported(version: str, prefixes) -> bool:
    return version.startswith(tuple(prefixes))


def describe_versions(prefixes) -> str:
    """``("3.3.",)`` -> ``"3.3.x"``."""
    return "/".join(p + "x" for p in prefixes)
