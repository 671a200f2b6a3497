"""The one place the CPU/gloo concerns change Paddle: every change is recorded with
its original, checked before it is made, and undone newest-first as a unit."""
from __future__ import annotations

import inspect
import threading

__all__ = ["Patcher", "PatchSignatureError"]

_MISSING = object()


class PatchSignatureError(RuntimeError):
    """A Paddle function a concern patches does not have the expected parameters."""


class Patcher:
    """Records ``(owner, name, original)`` for every attribute a concern replaces.

    Concerns call :meth:`check_params` on everything they will replace *before*
    the first :meth:`set`, so a Paddle that differs is refused before any change;
    :meth:`revert` restores every original, newest first.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._saved: list[tuple[object, str, object]] = []

    @property
    def applied(self) -> bool:
        return bool(self._saved)

    def patched(self) -> list[tuple[object, str]]:
        """``(owner, name)`` of every replaced attribute, in patch order."""
        return [(owner, name) for owner, name, _ in self._saved]

    @staticmethod
    def check_params(fn, names, where: str) -> None:
        try:
            got = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            got = None
        if got != list(names):
            raise PatchSignatureError(
                f"paddle_hybrid.cpu: {where} has parameters {got}, expected {list(names)}; this Paddle "
                "differs from the one the CPU/gloo patches were written for. Set "
                "PADDLE_HYBRID_CPU_HYBRID=off (PluginConfig(cpu_hybrid='off')) to run without them."
            )

    @staticmethod
    def require(owner, name: str, where: str):
        """``getattr(owner, name)``, or a clear error naming what this Paddle lacks."""
        if not hasattr(owner, name):
            raise PatchSignatureError(
                f"paddle_hybrid.cpu: {where} has no attribute {name!r}; unexpected Paddle. Set "
                "PADDLE_HYBRID_CPU_HYBRID=off to run without the CPU/gloo patches.")
        return getattr(owner, name)

    def set(self, owner, name: str, value) -> None:
        with self._lock:
            if isinstance(owner, type):
                original = owner.__dict__.get(name, _MISSING)
            else:
                original = getattr(owner, name, _MISSING)
            self._saved.append((owner, name, original))
            setattr(owner, name, value)

    def revert(self) -> None:
        with self._lock:
            while self._saved:
                owner, name, original = self._saved.pop()
                if original is _MISSING:
                    if name in vars(owner):
                        delattr(owner, name)
                else:
                    setattr(owner, name, original)
