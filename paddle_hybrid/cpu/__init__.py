"""What makes fleet's dygraph hybrid parallel run on CPU over gloo.

Stock Paddle 3.3.1 stops on a CPU build in many places; each concern below is one
module with an ``apply(patcher)`` that checks what it replaces, then replaces it
through the shared :class:`paddle_hybrid.patching.Patcher`.  :func:`install` applies them all
or none (a failure reverts what was applied and raises); :func:`uninstall`
restores every original.

=========================  ==================================================
concern                    what it fixes (details in the module's docstring)
=========================  ==================================================
:mod:`.device`             ``ParallelEnv._device_id`` missing on CPU
:mod:`.groups`             gloo group start-up race; per-neighbour p2p groups
:mod:`.p2p`                pipeline p2p on the pair groups; batched p2p on gloo
:mod:`.collectives`        reduce_scatter, which gloo lacks
:mod:`.tensor_parallel`    mp ops without CPU kernels (identity, split, concat,
                           parallel cross entropy) and the input broadcast
:mod:`.sharding`           stage 1 V1/V2 buffers and gradients, group-sharded
                           stage 2/3 device checks and clipping
:mod:`.recompute`          recompute with RNG state (hybrid, PipelineLayer)
:mod:`.timers`             ``enable_timer`` without a CUDA synchronize
:mod:`.virtual_pipeline`   interleaved VP with two pipeline stages
=========================  ==================================================

When: ``PluginConfig.cpu_hybrid`` ("auto": only when Paddle is not compiled
with CUDA; "on": always; "off": never).  The patches are written against
Paddle 3.3.x; on another version "on" raises and "auto" warns and does nothing.
"""
from __future__ import annotations

import warnings

from ..patching import Patcher, PatchSignatureError, describe_versions, version_supported

__all__ = ["install", "uninstall", "is_active", "patched", "SUPPORTED_PADDLE", "CONCERNS",
           "PatchSignatureError"]

SUPPORTED_PADDLE = ("3.3.",)

# Applied in this order (groups before p2p, which sends through them; p2p before
# virtual_pipeline, which is only safe with p2p's ordering).
CONCERNS = ["device", "groups", "p2p", "collectives", "tensor_parallel", "sharding", "recompute", "timers",
            "virtual_pipeline"]

_patcher = Patcher("paddle_hybrid.cpu", "PADDLE_HYBRID_CPU_HYBRID=off (PluginConfig(cpu_hybrid='off'))")


def _wanted(mode: str) -> bool:
    import paddle

    if mode == "off":
        return False
    if mode == "on":
        return True
    return not paddle.is_compiled_with_cuda()


def install(config) -> None:
    mode = config.cpu_hybrid
    if not _wanted(mode) or _patcher.applied:
        return
    import paddle

    version = paddle.__version__
    if not version_supported(version, SUPPORTED_PADDLE):
        msg = (f"paddle_hybrid.cpu: the CPU/gloo hybrid-parallel patches are written for Paddle "
               f"{describe_versions(SUPPORTED_PADDLE)}, found {version}.")
        if mode == "on":
            raise RuntimeError(msg + " Set PluginConfig(cpu_hybrid='off') (PADDLE_HYBRID_CPU_HYBRID=off) "
                                     "or use a supported Paddle.")
        warnings.warn(msg + " Not installing them (cpu_hybrid='auto').", RuntimeWarning, stacklevel=2)
        return
    _patcher.apply_modules(__name__, CONCERNS)


def uninstall() -> None:
    _patcher.revert()


def is_active() -> bool:
    """True while the CPU/gloo patches are installed."""
    return _patcher.applied


def patched() -> list:
    """``(owner, attribute name)`` of every Paddle attribute the CPU support replaced."""
    return _patcher.patched()
