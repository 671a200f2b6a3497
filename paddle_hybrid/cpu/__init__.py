"""What makes fleet's dygraph hybrid parallel (PP, VP, DP x PP, DP) run on CPU over gloo.

Stock Paddle 3.3.1 fails four ways on a CPU build; each fix is one patch here,
applied by :func:`install` and undone by :func:`uninstall`:

1. ``PipelineLayer`` reads ``ParallelEnv().device_id``, which is only set for
   CUDA/XPU/custom devices (``AttributeError: ... '_device_id'``).  Fix: a
   class-level default ``ParallelEnv._device_id = 0``.
2. Batched p2p (``pp_configs.use_batch_p2p_comm``, default True) sends on the
   calculation stream, which ``ProcessGroupGloo`` refuses.  Fix: on gloo the
   batched path posts the same ``isend``/``irecv`` pairs asynchronously on the
   per-neighbour groups of fix 3 and waits for all of them before returning,
   so the user's choice keeps working with the same results.
3. PP >= 3 hangs: gloo tags every operation with one counter per group, so
   p2p with two different peers in the pipeline group desynchronises the tags.
   Fix: one 2-rank group per pair of ring neighbours (created after the
   hybrid groups), and every pipeline p2p (tensors and shape metadata) goes
   through the group of its peer.
4. Creating gloo groups fails now and then at start-up (``Connection
   refused``, a pair ``TIMEOUT`` or a hang; ~40% of 3-rank launches here, also
   without this package, and the "DP x PP connection refused" of earlier
   notes): ``ProcessGroupGloo``'s constructor runs a second rendezvous on the
   *unprefixed* global store under the keys "0".."n-1", shared by every
   group, so a rank can read a peer's address from an earlier group.  Fix:
   each new gloo group gets its own TCPStore, hosted by the group's rank 0
   (address published on the global store under a key unique to the group
   id).  It replaces the barrier after every ``new_group`` used before, which
   only narrowed the race.

When: ``PluginConfig.cpu_hybrid`` ("auto": only when Paddle is not compiled
with CUDA; "on": always; "off": never).  The patches are written against
Paddle 3.3.x; on another version "on" raises and "auto" warns and does nothing.
"""
from __future__ import annotations

import warnings

from . import patches

__all__ = ["install", "uninstall", "is_active", "SUPPORTED_PADDLE"]

SUPPORTED_PADDLE = ("3.3.",)

_active = False


def _wanted(mode: str) -> bool:
    import paddle

    if mode == "off":
        return False
    if mode == "on":
        return True
    return not paddle.is_compiled_with_cuda()


def install(config) -> None:
    global _active
    mode = config.cpu_hybrid
    if not _wanted(mode):
        return
    import paddle

    version = paddle.__version__
    if not version.startswith(SUPPORTED_PADDLE):
        msg = (f"paddle_hybrid.cpu: the CPU/gloo hybrid-parallel patches are written for Paddle "
               f"{'/'.join(v + 'x' for v in SUPPORTED_PADDLE)}, found {version}.")
        if mode == "on":
            raise RuntimeError(msg + " Set PluginConfig(cpu_hybrid='off') (PADDLE_HYBRID_CPU_HYBRID=off) "
                                     "or use a supported Paddle.")
        warnings.warn(msg + " Not installing them (cpu_hybrid='auto').", RuntimeWarning, stacklevel=2)
        return
    patches.apply()
    _active = True


def uninstall() -> None:
    global _active
    patches.revert()
    _active = False


def is_active() -> bool:
    """True while the CPU/gloo patches are installed."""
    return _active
