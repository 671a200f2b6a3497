"""What makes fleet's dygraph hybrid parallel run on CPU over gloo.

Stock Paddle 3.3.1 stops on a CPU build in many places; each concern below is one
module with an ``apply(patcher)`` that checks what it replaces, then replaces it
through the shared :class:`paddle_hybrid.registry.patching.Patcher`.  :func:`install` applies them all
or none (a failure reverts what was applied and raises); :func:`uninstall`
restores every original.

=========================  ==================================================
concern                    what it fixes (details in the module's docstring)
=========================  ==================================================
:mod:`.device_id`          ``ParallelEnv().device_id`` missing on CPU
:mod:`.synchronize`        ``paddle.device.synchronize()`` refuses the CPU place
:mod:`.tcp_store`          the job's TCP store uses Paddle's classic server (the
                           libuv one aborts a rank at exit now and then) and
                           sends without Nagle's 40 ms delay
:mod:`.groups`             gloo group start-up race; per-neighbour p2p groups
:mod:`.gloo_deadline`      every gloo group waits ``PADDLE_HYBRID_TIMEOUT``, not
                           gloo's 30 s
:mod:`.gloo_errors`        a gloo timeout names the rank waited for and the
                           setting
:mod:`.p2p`                pipeline p2p on the pair groups; batched p2p on gloo
:mod:`.collectives`        reduce_scatter, which gloo lacks
:mod:`.tensor_parallel`    mp ops without CPU kernels (identity, split, concat,
                           parallel cross entropy) and the input broadcast
:mod:`.sharding`           stage 1 V1/V2 buffers and gradients, group-sharded
                           stage 2/3 device checks and clipping
:mod:`.recompute`          recompute with RNG state (hybrid, PipelineLayer)
:mod:`.timers`             ``enable_timer`` without a CUDA synchronize
:mod:`.flex_checkpoint`    flex-checkpoint resharding (dcp) moves buffers to
                           the GPU; on a CPU build they stay in host memory
:mod:`.virtual_pipeline`   interleaved VP with two pipeline stages
=========================  ==================================================

When: ``PluginConfig.cpu_hybrid``, an auto/on/off field of :mod:`paddle_hybrid.registry.gate`
("auto": only on a Paddle build with no accelerator, neither CUDA nor XPU nor a custom device,
unless ``allow_unrun``; "on": on any build; "off": never).  Installed is not the same
as used: each replacement asks per call whether its group is gloo, its tensor is in host memory
or the run is on the CPU (whichever its work depends on) and otherwise calls Paddle's original
unchanged, so ``"on"`` on an accelerator build leaves NCCL/BKCL groups and device tensors alone.
The patches are written against Paddle 3.3.x and checked on 3.2.x; on another version the
registry skips them with a warning unless forced
(``PADDLE_HYBRID_FORCE=cpu``).
"""
from __future__ import annotations

from ...registry.component import Component
from ...registry.patching import Patcher, PatchSignatureError

__all__ = ["COMPONENT", "apply", "is_active", "patched", "CONCERNS", "PatchSignatureError"]

# Applied in this order (groups before p2p, which sends through them; p2p before virtual_pipeline,
# which is only safe with p2p's ordering).
CONCERNS = ["device_id", "synchronize", "tcp_store", "groups", "p2p", "collectives", "tensor_parallel", "sharding",
            "recompute", "timers", "flex_checkpoint", "virtual_pipeline"]


def apply(config, patcher: Patcher) -> None:
    from . import gloo_deadline, gloo_errors

    patcher.apply_modules(__name__, CONCERNS)
    try:
        # The two concerns that need the config: the deadline, and its name in a timeout's message.
        gloo_deadline.apply(patcher, config)
        gloo_errors.apply(patcher, config)
    except BaseException:
        patcher.revert()
        raise


COMPONENT = Component("cpu", ("3.2.", "3.3."), "cpu_hybrid", apply)


def is_active() -> bool:
    """True while the CPU/gloo patches are installed."""
    return COMPONENT.is_active()


def patched() -> list:
    """``(owner, attribute name)`` of every Paddle attribute the CPU support replaced."""
    return COMPONENT.patched()
