"""The device rule: a path is on by default only on a device where it has executed and been tested.

Every path of the plugin that has never run on an accelerator is listed in :data:`UNRUN_PATHS`
with the config field that switches it.  Those fields are tri-state:

* ``None`` (the default, the variable unset): on where the path has run, which is a build of
  Paddle with no accelerator (CPU); off on a CUDA, XPU or custom-device build;
* ``True`` (``PADDLE_HYBRID_<FEATURE>=1``): on everywhere, an explicit opt-in;
* ``False`` (``=0``): off everywhere.

``PluginConfig.allow_unrun`` (``PADDLE_HYBRID_ALLOW_UNRUN=1``) opts in to every path at once.
Device-independent components whose effect was verified (reshard's deferred sync, the fleet
fixes, the registration of passes) are not listed here: they are on by default on every build.

:func:`decide` is the one place a feature asks whether it is on; :func:`describe` gives
``report()`` one line per path.
"""
from __future__ import annotations

import dataclasses

from .device import accelerator_build

__all__ = ["UnrunPath", "UNRUN_PATHS", "Decision", "decide", "describe", "opt_in_hint", "cpu_component_skip_reason"]


@dataclasses.dataclass(frozen=True)
class UnrunPath:
    """A path written for accelerators and executed only on CPU."""

    field: str
    """The :class:`~paddle_hybrid.config.PluginConfig` field (tri-state) that switches it."""
    env: str
    """Its environment variable."""
    what: str
    """What it changes on an accelerator build, for messages."""


UNRUN_PATHS: dict[str, UnrunPath] = {p.field: p for p in (
    UnrunPath("pipeline_send_wait", "PADDLE_HYBRID_PIPELINE_SEND_WAIT",
              "send-wait removes c_sync_comm_stream ops from static pipeline programs"),
    UnrunPath("static_fuse_allreduce", "PADDLE_HYBRID_STATIC_FUSE_ALLREDUCE",
              "the static fused all_reduce replaces RawProgramOptimizer (NCCL/BKCL all_reduce of fused buffers)"),
    UnrunPath("grad_buckets", "PADDLE_HYBRID_GRAD_BUCKETS",
              "the dygraph gradient buckets replace Paddle's data-parallel gradient sync"),
    UnrunPath("pipeline_cudagraph", "PADDLE_HYBRID_PIPELINE_CUDAGRAPH",
              "PipelineLayer(use_cudagraph=True) captures CUDA graphs with the plugin's backend"),
)}


def opt_in_hint(field: str) -> str:
    path = UNRUN_PATHS[field]
    return f"opt in with {path.env}=1 (PluginConfig({field}=True)) or PADDLE_HYBRID_ALLOW_UNRUN=1"


@dataclasses.dataclass(frozen=True)
class Decision:
    on: bool
    reason: str
    """Why, for ``report()`` and skip messages (empty when on where it has run)."""


def decide(config, field: str, accelerator: str | None = ...) -> Decision:
    """Is the path switched by ``config.<field>`` on for this build?

    ``accelerator`` defaults to :func:`~paddle_hybrid.device.accelerator_build` (tests pass one).
    """
    if field not in UNRUN_PATHS:
        raise KeyError(f"paddle_hybrid.device_rule: {field!r} is not a path of the device rule; "
                       f"known: {sorted(UNRUN_PATHS)}.")
    value = getattr(config, field)
    if value is False:
        return Decision(False, f"switched off ({field}=False)")
    if accelerator is ...:
        accelerator = accelerator_build()
    if accelerator is None:
        return Decision(True, "")
    if value is True:
        return Decision(True, f"opted in ({field}=True): written, never run on {accelerator}")
    if getattr(config, "allow_unrun", False):
        return Decision(True, f"opted in (allow_unrun=True): written, never run on {accelerator}")
    return Decision(False, f"written, never run on {accelerator}: {opt_in_hint(field)}")


def describe(config, accelerator: str | None = ...) -> list[str]:
    """One line per unrun path: on, off and why."""
    if accelerator is ...:
        accelerator = accelerator_build()
    lines = []
    for field in UNRUN_PATHS:
        decision = decide(config, field, accelerator)
        state = "on" if decision.on else "off"
        lines.append(f"{field:22s} {state}" + (f": {decision.reason}" if decision.reason else ""))
    return lines


def cpu_component_skip_reason(setting: str, field: str, env: str, what: str) -> str | None:
    """Why a CPU/gloo component with an ``auto|on|off`` setting is not installed, or None.

    ``auto`` installs only on a build with no accelerator (the paths ran on CPU only), ``on``
    everywhere (each replacement still hands non-gloo groups and device tensors to Paddle),
    ``off`` never.  ``what`` names the paths in the message ("the CPU/gloo emulations")."""
    from . import device  # looked up at each call: the build's answer (or a test's fake) now

    if setting == "off":
        return f"switched off ({field}='off')"
    accelerator = device.accelerator_build() if setting == "auto" else None
    if accelerator is not None:
        return (f"not installed: this Paddle build has an accelerator ({accelerator}) and {what} never ran "
                f"there; {field}='on' ({env}=on) forces them, and each replacement still hands non-gloo groups "
                "and device tensors to Paddle")
    return None
