"""Run a function right after a module is imported, whenever that happens.

The plugin is imported before PaddleFormers (the launcher imports it in every worker before the
user's script runs), and importing PaddleFormers' trainer at ``import paddle_hybrid`` would pull
in transformers and more for every user.  So a fix of a PaddleFormers module waits for that
module: :func:`when_imported` runs ``callback(module)`` at once if the module is loaded, else
after its first import finishes, through a finder on ``sys.meta_path`` that wraps the module's
loader.  The returned function removes the finder (the registry calls it at uninstall).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading

__all__ = ["when_imported", "when_import_fails"]


class _AfterExecLoader(importlib.abc.Loader):
    """The module's own loader, then ``callback(module)``."""

    def __init__(self, loader, callback):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback(module)


class _FailingExecLoader(importlib.abc.Loader):
    """The module's own loader; an exception from it goes through ``translate(exc)``, which
    returns the exception to raise instead (chained to the original) or None."""

    def __init__(self, loader, translate):
        self._loader, self._translate = loader, translate

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001  (re-raised, or replaced by a clearer one)
            clearer = self._translate(exc)
            if clearer is None:
                raise
            raise clearer from exc


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback, loader_cls=None):
        self.name, self.callback = name, callback
        self.loader_cls = loader_cls or _AfterExecLoader
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or getattr(self._finding, "active", False):
            return None
        self._finding.active = True  # the lookup below must not find this finder again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None:
            return None
        if self.loader_cls is _AfterExecLoader:
            spec.loader = _AfterExecLoader(spec.loader, self._run_once)
        else:
            spec.loader = self.loader_cls(spec.loader, self.callback)
        return spec

    def _run_once(self, module):
        remove(self)
        self.callback(module)


def remove(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def when_imported(name: str, callback):
    """``callback(module)`` now if ``name`` is imported, else once right after its import;
    returns a function that cancels a wait not yet over."""
    if name in sys.modules:
        callback(sys.modules[name])
        return lambda: None
    finder = _PostImportFinder(name, callback)
    sys.meta_path.insert(0, finder)
    return lambda: remove(finder)


def when_import_fails(name: str, translate):
    """While installed, an exception from importing module ``name`` is passed to
    ``translate(exc)``; what it returns is raised instead, chained to the original (None: the
    original).  Returns a function that removes the hook."""
    finder = _PostImportFinder(name, translate, _FailingExecLoader)
    sys.meta_path.insert(0, finder)
    return lambda: remove(finder)
