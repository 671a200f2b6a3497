"""Configuration of the plugin: every knob in one validated dataclass.

Environment variables are read here and nowhere else (:meth:`PluginConfig.from_env`).
"""
from __future__ import annotations

import dataclasses
import os

__all__ = ["PluginConfig"]


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"paddle_hybrid: environment variable {name}={raw!r} is not a boolean; use 1 or 0.")


@dataclasses.dataclass(frozen=True)
class PluginConfig:
    """What ``import paddle_hybrid`` installs.

    Each field can be set from the environment variable named in its doc.
    """

    register_meta_optimizers: bool = True
    """Add the plugin's meta optimizers to fleet's factory (``PADDLE_HYBRID_META_OPTIMIZERS``)."""

    reshard_deferred_sync: bool = True
    """Legacy auto-parallel ``Resharder.reshard`` edits programs without a ``_sync_with_cpp``
    per inserted op (:mod:`paddle_hybrid.passes.reshard`) (``PADDLE_HYBRID_RESHARD_DEFERRED_SYNC``)."""

    pipeline_send_wait: bool = True
    """With fleet ``strategy.pipeline`` (static), replace the waits for forward sends by a ``ph_nop``
    after the matching backward recv (:mod:`paddle_hybrid.passes.pipeline_send_wait`)
    (``PADDLE_HYBRID_PIPELINE_SEND_WAIT``)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"PluginConfig.{f.name} must be a bool, got {value!r}.")

    @classmethod
    def from_env(cls) -> "PluginConfig":
        return cls(
            register_meta_optimizers=_env_bool("PADDLE_HYBRID_META_OPTIMIZERS", True),
            reshard_deferred_sync=_env_bool("PADDLE_HYBRID_RESHARD_DEFERRED_SYNC", True),
            pipeline_send_wait=_env_bool("PADDLE_HYBRID_PIPELINE_SEND_WAIT", True),
        )
