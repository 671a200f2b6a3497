"""PaddleFormers 1.2's Qwen2-MoE, Qwen3-MoE and GLM4-MoE on a machine without paddlefleet: stand-ins
for the two GPU-only imports, and PaddleFormers' own model classes picked by the Auto classes.

What stops them (PaddleFormers 1.2.0, a CPU build, every machine without paddlefleet):

* ``paddleformers/transformers/gpt_provider.py`` raises ``ImportError("paddlefleet is required ...")``
  at import; every Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / GLM4-MoE model module imports it for the
  base class of its ``...ModelProvider`` dataclass (paddlefleet's ``GPTModel`` is built from it).
* ``paddleformers/transformers/fused_a2a.py`` does ``from paddlefleet_ops import is_deep_ep_available``
  at import; ``token_dispatcher.py`` imports it, ``nn/moe_deepep/modular_moe_layer.py`` imports that,
  and Qwen3-MoE, GLM4-MoE and DeepSeek-V3 import that.  ``fused_a2a`` itself already handles DeepEP
  being absent (``HAVE_DEEP_EP = False``, ``fused_dispatch = None``); only the import of the answer
  fails.
* ``AutoModelForCausalLM`` maps these families to ``...ForCausalLM``, whose ``__new__`` builds
  paddlefleet's ``GPTModel``.  PaddleFormers keeps its own model of each as
  ``...ForCausalLMDeprecated`` (and ``...ForCausalLMPipeDeprecated``), which the Auto class takes
  only when the first class does not exist.

The stand-ins, made only while the package they stand for cannot be found (``find_spec``), only on
PaddleFormers 1.2.x (another version: a warning and the stock import error):

* ``gpt_provider``: a module of this file's making (:func:`gpt_provider_standin`): ``GPTModelProvider``
  is a base class the providers subclass as before, and building a model from it
  (``from_config``, ``provide``) raises :class:`PaddlefleetAbsentError`, naming the class to use
  instead; ``GPTModel`` raises the same when built.  Nothing else of paddlefleet's is offered.
* ``fused_a2a``: PaddleFormers' own module, executed with a ``paddlefleet_ops`` stand-in that
  answers ``is_deep_ep_available()`` with False (and raises for anything else) in ``sys.modules``
  for the time of that import only: afterwards ``import paddlefleet_ops`` fails as before.
* ``AutoModelForCausalLM`` / ``AutoModelForCausalLMPipe`` (``_get_model_class_from_config``, the
  one place both ``from_pretrained`` and ``from_config`` choose the class): a class built by
  paddlefleet (``is_fleet``) whose module has a ``<name>Deprecated`` twin is replaced by that twin,
  with an :class:`OwnModelWarning` naming both.  So ``AutoModelForCausalLM.from_pretrained(...)`` of a
  Qwen3-MoE checkpoint returns ``Qwen3MoeForCausalLMDeprecated`` here and paddlefleet's model where
  paddlefleet is installed.  ``Qwen3MoeForCausalLM(config)`` named directly still needs paddlefleet
  and says so.

``paddle_hybrid.uninstall()`` removes the finder and the Auto classes' change; a module already
imported with a stand-in stays what it is in ``sys.modules`` (an import cannot be undone).

What these models then need beyond one process is :mod:`.moe_dispatcher` (expert parallelism on the
all-to-all path, and the layouts refused by name).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
import warnings

__all__ = ["GPT_PROVIDER", "FUSED_A2A", "AUTO_MODELING", "PaddlefleetAbsentError", "OwnModelWarning", "absent",
           "StandInFinder", "gpt_provider_standin", "own_model", "apply_to_auto", "is_standin"]

GPT_PROVIDER = "paddleformers.transformers.gpt_provider"
FUSED_A2A = "paddleformers.transformers.fused_a2a"
AUTO_MODELING = "paddleformers.transformers.auto.modeling"
# module: the package it needs at import
NEEDS = {GPT_PROVIDER: "paddlefleet", FUSED_A2A: "paddlefleet_ops"}
STANDIN_MARK = "__paddle_hybrid_standin__"


class PaddlefleetAbsentError(ImportError):
    """A model PaddleFormers builds with paddlefleet, asked for where paddlefleet is absent."""


class OwnModelWarning(UserWarning):
    """The Auto class gave PaddleFormers' own model of a family instead of paddlefleet's."""


def absent(package: str) -> bool:
    """True when ``package`` can neither be found nor is already in ``sys.modules``."""
    if package in sys.modules:
        return False
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):
        return True


def is_standin(module) -> bool:
    return getattr(module, STANDIN_MARK, None) is not None


def _twins(module_name: str) -> list[str]:
    module = sys.modules.get(module_name)
    if module is None:
        return []
    return sorted(name for name in getattr(module, "__all__", None) or vars(module) if name.endswith("Deprecated"))


def _absent_message(what: str, module_name: str) -> str:
    twins = _twins(module_name)
    own = (f"PaddleFormers' own model of this family is {' / '.join(twins)}, which AutoModelForCausalLM "
           f"(AutoModelForCausalLMPipe) returns while paddlefleet is absent"
           if twins else "PaddleFormers 1.2 has no model of its own for this family")
    return (f"{what} is paddlefleet's GPTModel, and paddlefleet is not installed (a GPU-only package, not on the "
            f"package index); {own}. (paddle_hybrid.paddleformers_fixes.paddlefleet_standins)")


def gpt_provider_standin() -> types.ModuleType:
    """What ``paddleformers.transformers.gpt_provider`` is without paddlefleet: the base class its
    importers subclass, and nothing that builds a model."""
    module = types.ModuleType(GPT_PROVIDER, "Stand-in of PaddleFormers' gpt_provider without paddlefleet "
                                            "(paddle_hybrid.paddleformers_fixes.paddlefleet_standins).")
    setattr(module, STANDIN_MARK, "paddlefleet")

    class GPTModelProvider:
        """Base of the families' ``...ModelProvider`` dataclasses; builds nothing without paddlefleet."""

        transform_rules: dict = {}

        @classmethod
        def from_config(cls, config, *args, **kwargs):
            raise PaddlefleetAbsentError(_absent_message(f"the model {cls.__name__} provides", cls.__module__))

        def provide(self, *args, **kwargs):
            raise PaddlefleetAbsentError(_absent_message(f"the model {type(self).__name__} provides",
                                                         type(self).__module__))

    class GPTModel:
        """paddlefleet's model: never built here (``isinstance`` checks see a class no model is of)."""

        def __new__(cls, *args, **kwargs):
            raise PaddlefleetAbsentError(_absent_message("GPTModel", GPT_PROVIDER))

    for cls in (GPTModelProvider, GPTModel):
        cls.__module__ = GPT_PROVIDER
    module.GPTModelProvider, module.GPTModel = GPTModelProvider, GPTModel
    module.__all__ = ["GPTModelProvider", "GPTModel"]
    return module


def _paddlefleet_ops_standin() -> types.ModuleType:
    class Ops(types.ModuleType):
        def __getattr__(self, name):
            raise AttributeError(f"paddlefleet_ops is not installed (a stand-in answered only is_deep_ep_available: "
                                 f"False); {name!r} needs the real package. "
                                 "(paddle_hybrid.paddleformers_fixes.paddlefleet_standins)")

    ops = Ops("paddlefleet_ops")
    ops.is_deep_ep_available = lambda: False
    return ops


class _StandInLoader(importlib.abc.Loader):
    """Builds the gpt_provider stand-in in place of the module."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        made = gpt_provider_standin()
        module.__dict__.update({k: v for k, v in vars(made).items() if k not in ("__name__", "__spec__", "__loader__")})


class _WithOpsLoader(importlib.abc.Loader):
    """PaddleFormers' ``fused_a2a``, executed while ``paddlefleet_ops`` is the stand-in."""

    _lock = threading.RLock()

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with self._lock:
            had = sys.modules.get("paddlefleet_ops")
            sys.modules["paddlefleet_ops"] = _paddlefleet_ops_standin()
            try:
                self._loader.exec_module(module)
            finally:
                if had is None:
                    sys.modules.pop("paddlefleet_ops", None)
                else:
                    sys.modules["paddlefleet_ops"] = had
        if getattr(module, "HAVE_DEEP_EP", None) is not False or getattr(module, "fused_dispatch", 0) is not None:
            raise ImportError(f"{FUSED_A2A} did not take DeepEP as absent under the paddlefleet_ops stand-in; this "
                              "PaddleFormers differs from 1.2. "
                              "(paddle_hybrid.paddleformers_fixes.paddlefleet_standins)")
        setattr(module, STANDIN_MARK, "paddlefleet_ops")


class StandInFinder(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path``: the two modules of :data:`NEEDS`, each while its package is absent and
    ``allowed()`` (a verified PaddleFormers; it warns otherwise)."""

    def __init__(self, allowed):
        self._allowed = allowed
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in NEEDS or getattr(self._finding, "active", False):
            return None
        if not absent(NEEDS[fullname]) or not self._allowed():
            return None
        if fullname == GPT_PROVIDER:
            return importlib.machinery.ModuleSpec(fullname, _StandInLoader())
        self._finding.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _WithOpsLoader(spec.loader)
        return spec


# ------------------------------------------------------------------ the Auto classes


def own_model(model_class):
    """PaddleFormers' own twin (``<name>Deprecated``) of a class built by paddlefleet, when the
    paddlefleet stand-in is in use; else None."""
    if not is_standin(sys.modules.get(GPT_PROVIDER)) or not getattr(model_class, "is_fleet", False):
        return None
    twin = getattr(sys.modules.get(getattr(model_class, "__module__", "")), model_class.__name__ + "Deprecated", None)
    return twin if isinstance(twin, type) else None


def _make_choose(original):
    @functools.wraps(original)
    def _get_model_class_from_config(cls, *args, **kwargs):
        model_class = original(cls, *args, **kwargs)
        twin = own_model(model_class)
        if twin is None:
            return model_class
        warnings.warn(f"{cls.__name__}: paddlefleet is not installed, so {model_class.__name__} (paddlefleet's "
                      f"GPTModel) cannot be built; using PaddleFormers' own {twin.__name__} "
                      "(paddle_hybrid.paddleformers_fixes.paddlefleet_standins).", OwnModelWarning, stacklevel=3)
        return twin

    return _get_model_class_from_config


def apply_to_auto(patcher, auto_modeling) -> None:
    """``_BaseAutoModelClass._get_model_class_from_config`` (a classmethod) gives the own twin."""
    base = patcher.require(auto_modeling, "_BaseAutoModelClass", AUTO_MODELING)
    raw = base.__dict__.get("_get_model_class_from_config")
    if not isinstance(raw, classmethod):
        from ...registry.patching import PatchSignatureError

        raise PatchSignatureError(f"{patcher.component}: {AUTO_MODELING}._BaseAutoModelClass._get_model_class_from_"
                                  f"config is not a classmethod; unexpected PaddleFormers. Set {patcher.off_switch} "
                                  "to run without these patches.")
    patcher.check_params(raw.__func__, ["cls", "pretrained_model_name_or_path", "config_file_path", "config",
                                        "is_lora"], f"{AUTO_MODELING}._BaseAutoModelClass._get_model_class_from_config")
    patcher.set(base, "_get_model_class_from_config", classmethod(_make_choose(raw.__func__)))
