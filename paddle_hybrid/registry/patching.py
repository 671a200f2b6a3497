"""How a component changes Paddle: every change is recorded with its original, checked
before it is made, and undone newest-first as a unit (:class:`Patcher`).

**Two owners of one attribute.**  Two components may wrap the same Paddle function (the fleet
fixes and the gradient buckets both wrap ``HybridParallelOptimizer._hybrid_sync_grad``); the
second wraps what it finds, which is the first one's replacement.  A blind ``setattr`` of the
first one's original at its undo would then throw the second wrapper away while its component
still reports itself active.  So every function a patcher installs is a *link*: a thin function
that calls its implementation through a cell.  Undoing a link that something else has wrapped
since (it is no longer the attribute's value) splices it out instead: the cell is pointed at what
the link wrapped, and the wrapper above keeps working.  Undoing the wrapper above later restores
the first original, by identity, following spliced links.  A non-function value that somebody
else has replaced since cannot be spliced: its undo raises :class:`PatchConflictError` naming
both.

**Device answers.**  Where Paddle asks a device question that has no answer on a CPU build (is
this build compiled with CUDA? which custom devices are there? what are the GPU's properties?),
:meth:`Patcher.answer` replaces the *module* one Paddle module asks through (its global
``paddle`` or ``core``) by a :class:`DeviceAnswers` view: the named attributes answer for the
CPU while a condition holds, everything else is the real module's.  Only that Paddle module sees
the view, nothing is changed globally, and ``patches()`` lists it like any other change.
"""
from __future__ import annotations

import functools
import inspect
import threading
import types

__all__ = ["Patcher", "PatchSignatureError", "PatchConflictError", "DeviceAnswers", "version_supported",
           "describe_versions"]

_MISSING = object()


class PatchConflictError(RuntimeError):
    """An attribute a patcher replaced was replaced again by something else, and the patcher's
    value is not a function that can be spliced out of the chain."""


def _make_link(implementation):
    """A function that calls ``implementation`` through a cell (see the module docstring)."""
    cell = [implementation]

    @functools.wraps(implementation)
    def link(*args, **kwargs):
        return cell[0](*args, **kwargs)

    link._ph_link_cell = cell
    link._ph_spliced = False
    return link


def _is_link(value) -> bool:
    return callable(value) and hasattr(value, "_ph_link_cell")


def _splice_out(link, below) -> None:
    """Make ``link`` call ``below`` (what it wrapped) from now on."""
    link._ph_link_cell[0] = below
    link.__wrapped__ = below
    link._ph_spliced = True


def _resolve_original(original):
    """Follow links that were spliced out: they only forward to what they wrapped."""
    while _is_link(original) and original._ph_spliced:
        original = original._ph_link_cell[0]
    return original


def _current(owner, name):
    if isinstance(owner, type):
        return owner.__dict__.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


class PatchSignatureError(RuntimeError):
    """A Paddle function a concern patches does not have the expected parameters."""


class DeviceAnswers:
    """A module as one Paddle module sees it: the attributes in ``answers`` answer for the CPU
    while ``when()`` is true; everything else, and everything while it is false, is the real
    module's.  A value in ``answers`` that is a dict answers inside a submodule
    (``{"device": {"synchronize": ...}}`` for ``paddle.device.synchronize``)."""

    def __init__(self, real, answers: dict, when, why: str):
        self._real, self._when, self._why = real, when, why
        self._answers, self._inner = {}, {}
        for name, value in answers.items():
            if isinstance(value, dict):
                self._inner[name] = DeviceAnswers(getattr(real, name), value, when, why)
            else:
                self._answers[name] = value

    def __getattr__(self, name):
        if name in self._inner:
            return self._inner[name]
        if name in self._answers and self._when():
            return self._answers[name]
        return getattr(self._real, name)

    def answered(self) -> list[str]:
        """Dotted names of every answered attribute."""
        return sorted([*self._answers, *(f"{k}.{n}" for k, view in self._inner.items() for n in view.answered())])

    def __repr__(self):
        return f"<{self._real.__name__} answering {self.answered()} for the CPU: {self._why}>"


def _answers_tree(dotted: dict) -> dict:
    """``{"device.synchronize": f}`` -> ``{"device": {"synchronize": f}}``."""
    tree: dict = {}
    for name, value in dotted.items():
        *parents, leaf = name.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


class Patcher:
    """Records ``(owner, name, original)`` for every attribute a concern replaces.

    Concerns call :meth:`check_params` on everything they will replace *before*
    the first :meth:`set`, so a Paddle that differs is refused before any change;
    :meth:`revert` restores every original, newest first.
    """

    def __init__(self, component: str, off_switch: str):
        """``component`` names who patches in error messages (``"paddle_hybrid.dygraph.cpu"``);
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
        """Replace ``owner.name`` by ``value``; a plain function is installed as a link (see the
        module docstring), so another component may wrap it and either may be undone first."""
        with self._lock:
            original = _current(owner, name)
            installed = _make_link(value) if isinstance(value, types.FunctionType) else value
            self._saved.append((owner, name, original, installed))
            setattr(owner, name, installed)

    def answer(self, module, name: str, answers: dict, when, why: str) -> None:
        """Paddle asks about the device in ``module``: its global ``name`` (the real module it
        imported, ``paddle`` or ``core``) becomes a :class:`DeviceAnswers` view whose attributes
        named by the dotted keys of ``answers`` give those values while ``when()`` is true.
        ``why`` says what the answer is for (``patches()`` shows it)."""
        real = self.require(module, name, getattr(module, "__name__", repr(module)))
        if not isinstance(real, (types.ModuleType, DeviceAnswers)):  # another component's answer may be below
            raise PatchSignatureError(
                f"{self.component}: {getattr(module, '__name__', module)}.{name} is {real!r}, not the module the "
                f"device answer expects; unexpected Paddle. Set {self.off_switch} to run without these patches.")
        for dotted in answers:
            owner = real
            for part in dotted.split("."):
                owner = self.require(owner, part, f"{real.__name__} (for {dotted})")
        self.set(module, name, DeviceAnswers(real, _answers_tree(answers), when, why))

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
                owner, name, original, installed = self._saved.pop()
                try:
                    self._undo(owner, name, original, installed)
                except Exception as exc:  # keep undoing the rest, report below
                    failures.append(f"{name}: {exc!r}")
        if failures:
            raise RuntimeError(f"{self.component}: could not undo " + "; ".join(failures))

    def _undo(self, owner, name, original, installed) -> None:
        if owner is None:
            original()
            return
        original = _resolve_original(original)
        if _current(owner, name) is not installed:
            # Wrapped again since, by another component: leave its wrapper in place.
            if _is_link(installed) and original is not _MISSING:
                _splice_out(installed, original)
                return
            raise PatchConflictError(
                f"{self.component}: {getattr(owner, '__name__', owner)}.{name} was replaced again after this "
                "component replaced it, and its value cannot be spliced out; undo the later change first.")
        if original is _MISSING:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, original)


def version_supported(version: str, prefixes) -> bool:
    return version.startswith(tuple(prefixes))


def describe_versions(prefixes) -> str:
    """``("3.3.",)`` -> ``"3.3.x"``."""
    return "/".join(p + "x" for p in prefixes)
