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

__all__ = ["when_imported"]


class _AfterExecLoader(importlib.abc.Loader):
    """The module's own loader, then ``callback(module)``."""

    def __init__(self, loader, callback):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback
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
        spec.loader = _AfterExecLoader(spec.loader, self._run_once)
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
