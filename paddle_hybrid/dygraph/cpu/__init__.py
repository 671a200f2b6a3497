"""What makes fleet's dygraph hybrid parallel run on CPU over gloo.

Stock Paddle 3.3.1 stops on a CPU build in many places; each concern below is one module with
an ``apply(config, patcher)`` that checks what it replaces, then replaces it through the
component's :class:`~paddle_hybrid.registry.patching.Patcher`.  The component's :func:`apply`
applies them in the order of :data:`CONCERNS`; the registry installs it all or none (a failure
reverts what was applied) and ``paddle_hybrid.uninstall()`` restores every original.  The gloo
backend itself (group rendezvous, deadlines and their errors, the job's store, the collectives
gloo lacks) is the layer :mod:`paddle_hybrid.gloo`; this component installs its parts.

=========================================  ==================================================
concern                                    what it fixes (details in the module's docstring)
=========================================  ==================================================
:mod:`.device_id`                          ``ParallelEnv().device_id`` missing on CPU
:mod:`.synchronize`                        ``paddle.device.synchronize()`` refuses the CPU place
:mod:`paddle_hybrid.gloo.tcp_store`        the job's TCP store uses Paddle's classic server (the
                                           libuv one aborts a rank at exit now and then) and
                                           sends without Nagle's 40 ms delay
:mod:`paddle_hybrid.gloo.groups`           gloo group start-up race; per-neighbour p2p groups
:mod:`.p2p`                                pipeline p2p on the pair groups; batched p2p on gloo
:mod:`paddle_hybrid.gloo.kernels`          Paddle's C++ reaches real CPU kernels over gloo for
                                           reduce_scatter, all_to_all, p_send/p_recv (semi-auto
                                           reshards, pipelines across meshes), and no
                                           GetDefaultPlace() crash on the CPU wheel; Paddle's
                                           Python reduce_scatter on gloo groups uses the kernel
                                           (:mod:`paddle_hybrid.gloo.collectives`)
:mod:`paddle_hybrid.gloo.local_ring`      all_reduce, broadcast and all_gather of a one-node
                                           gloo group through shared memory, not TCP
                                           (``PADDLE_HYBRID_LOCAL_RING``, default on)
:mod:`paddle_hybrid.gloo.local_p2p`       send/recv of a one-node gloo group through shared
                                           memory, buffered (``PADDLE_HYBRID_LOCAL_P2P``)
:mod:`.tensor_parallel`                    mp ops without CPU kernels (identity, split, concat,
                                           parallel cross entropy) and the input broadcast
:mod:`.sharding`                           stage 1 V1/V2 buffers and gradients, group-sharded
                                           stage 2/3 device checks and clipping
:mod:`.recompute`                          recompute with RNG state (hybrid, PipelineLayer)
:mod:`.timers`                             ``enable_timer`` without a CUDA synchronize
:mod:`.flex_checkpoint`                    flex-checkpoint resharding (dcp) moves buffers to
                                           the GPU; on a CPU build they stay in host memory
:mod:`.virtual_pipeline`                   interleaved VP with two pipeline stages
:mod:`paddle_hybrid.gloo.deadline`         every gloo group waits ``PADDLE_HYBRID_TIMEOUT``,
                                           not gloo's 30 s
:mod:`paddle_hybrid.gloo.errors`           a gloo timeout names the rank waited for and the
                                           setting
=========================================  ==================================================

When: ``PluginConfig.cpu``, an auto/on/off field of :mod:`paddle_hybrid.registry.gate`
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

from ...gloo import deadline, errors, fake_world, groups, kernels, local_p2p, local_ring, tcp_store
from ...registry.component import Component
from ...registry.patching import Patcher, PatchSignatureError
from . import (device_id, flex_checkpoint, p2p, recompute, sharding, synchronize, tensor_parallel, timers,
               virtual_pipeline)

__all__ = ["COMPONENT", "apply", "is_active", "patched", "CONCERNS", "PatchSignatureError"]

# Applied in this order: groups before p2p, which sends through them; p2p before virtual_pipeline,
# which is only safe with p2p's ordering; the deadline and the named errors last, around the
# groups every earlier concern may create; the fake world (a dry run's) outermost, so no group it makes
# reaches gloo's creation or its deadline's.
CONCERNS = (device_id, synchronize, tcp_store, groups, p2p, kernels, local_ring, local_p2p, tensor_parallel, sharding,
            recompute, timers, flex_checkpoint, virtual_pipeline, deadline, errors, fake_world)


def apply(config, patcher: Patcher) -> None:
    for concern in CONCERNS:
        concern.apply(config, patcher)


COMPONENT = Component("cpu", ("3.2.", "3.3."), "cpu", apply)


def is_active() -> bool:
    """True while the CPU/gloo patches are installed."""
    return COMPONENT.is_active()


def patched() -> list:
    """``(owner, attribute name)`` of every Paddle attribute the CPU support replaced."""
    return COMPONENT.patched()
