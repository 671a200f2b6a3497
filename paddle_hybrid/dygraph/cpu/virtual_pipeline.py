"""Interleaved virtual pipeline (``PipelineLayer(num_virtual_pipeline_stages=v)``) with
two pipeline stages.

Why stock Paddle 3.3.1 refuses it ("virtual pipeline must run under pp degree > 2")
-------------------------------------------------------------------------------
With two stages a rank's previous and next stage are the same rank.  The interleaved
1F1B schedule exchanges in all four directions at once (``P2pHelper.
send_forward_backward_recv_forward_backward``, the last warm-up step and every steady
step): an activation for the next stage and a gradient for the previous one go out in
one batch, and an activation and a gradient come in.  With pp == 2 both outgoing
tensors go to the one peer and both incoming ones come from it.

Paddle's default path (``use_batch_p2p_comm=True``, ``_batched_p2p_ops`` without
``PADDLE_P2P_SYNC_SEND``) posts a batch in the same order on every rank: send_prev,
recv_prev, send_next, recv_next.  Inside a group call NCCL pairs the messages between
two ranks in posting order, so rank A's first message to B (its *gradient*, send_prev)
lands in B's first receive from A (recv_prev, the *activation* buffer), and the
activation lands in the gradient buffer: silently wrong training when both have the
same shape (hidden states of a transformer do), a size error or a hang otherwise.  With
pp > 2 the two tensors of a batch go to different peers and cannot be confused; plain
1F1B never puts two tensors for one peer in a batch.  (Megatron-LM had the same
restriction for the same reason.)

Why it is correct with the CPU/gloo patches
-------------------------------------------
:mod:`.p2p` replaces both ``_p2p_ops`` and ``_batched_p2p_ops`` by one posting in
Paddle's stage-parity order (even stage: send_next, recv_prev, send_prev, recv_next;
odd stage: recv_prev, send_next, recv_next, send_prev) on the pair group of the peer.
With two stages, stage 0's sequence is the complement of stage 1's position by position
(activation 0->1, activation 1->0, gradient 0->1, gradient 1->0), and so is any subset
the schedule leaves on both sides of a call.  Gloo runs each send/recv to completion
and tags it with the group's operation counter, so the k-th operation of one rank meets
the k-th of the other, of the same kind and direction: the single pair group that
:func:`.groups.pair_list` gives for pp == 2 carries all four directions correctly (a
group per direction is not needed).  The shape/dtype meta messages go one way at a
time: stage 0 sends its meta at its first forward, before any four-way exchange.

Patches (each replaces ``_check_sanity``, which holds the assertion; written against
Paddle 3.3.1):

1. ``PipelineParallelWithInterleave._check_sanity`` (accumulate_steps >= 2 * pp): with
   pp == 2 on a gloo pipeline group, Paddle's checks except "pp degree > 2"; other degrees
   and other backends: Paddle's own.  The lift is decided when the check runs (at the
   model's construction), not at install: it is safe only where :mod:`.p2p` posts in parity
   order, which it does only on a gloo pipeline group; on NCCL/BKCL Paddle's batch order
   would swap activation and gradient, so there Paddle's refusal stands.
2. ``PipelineParallelWithInterleaveFthenB._check_sanity`` (pp <= accumulate_steps <
   2 * pp, also used by ``VPPFhenBInBalancedMemory``): the same, gloo included.  This
   schedule never exchanges in four directions, so it would be safe even with Paddle's batch
   order, but it has only run on gloo: elsewhere Paddle's refusal stands (the device rule).

Before replacing, the concern reads the source of each ``_check_sanity`` and lifts only a
check that holds Paddle's assertion; when the source cannot be read (a Paddle shipped without
its ``.py`` files) it cannot tell what it would replace, so it replaces nothing and warns: two
stages then stay refused by Paddle, the rest of the CPU support installs.

Tested: PP2 x VP2 and PP2 x VP3, ``use_batch_p2p_comm`` False and True, both schedules,
every rank against one process (``tests/hybrid/test_virtual_pipeline_pp2.py``).
"""
from __future__ import annotations

import functools
import inspect
import warnings

from ...registry.device import is_gloo

__all__ = ["apply"]

_PADDLE_MSG = "virtual pipeline must run under pp degree > 2"


def _make_check_sanity(orig, cls_name, min_acc_per_stage):
    """``_check_sanity`` that accepts two stages.  ``min_acc_per_stage``: the schedule
    needs accumulate_steps >= that * pp (Paddle's second check; 0 = none)."""

    @functools.wraps(orig)
    def _check_sanity(self):
        if self.num_stages != 2 or not is_gloo(self._hcg.get_pipe_parallel_group()):
            return orig(self)  # Paddle's checks and messages, unchanged
        from paddle import framework

        # Paddle 3.3.1's other checks of this method, in its order.
        if not framework.in_dynamic_mode():
            raise AssertionError(f"{cls_name}: the interleaved virtual pipeline runs only in dygraph mode.")
        if min_acc_per_stage and self.accumulate_steps < min_acc_per_stage * self.num_stages:
            raise AssertionError(
                f"{cls_name}: accumulate_steps ({self.accumulate_steps}) must be >= "
                f"{min_acc_per_stage} * pp degree ({self.num_stages}).")
        return None

    return _check_sanity


def _p2p_patched(patcher, p2p) -> bool:
    done = {(id(owner), name) for owner, name in patcher.patched()}
    return all((id(p2p), name) in done for name in ("_p2p_ops", "_batched_p2p_ops"))


class _SourceUnreadable(Exception):
    """The source of a ``_check_sanity`` cannot be read, so what it checks is unknown."""


def _holds_assertion(cls, orig) -> bool:
    """The class's own ``_check_sanity`` still contains the check this concern lifts.
    Raises :class:`_SourceUnreadable` when its source cannot be read: replacing a check
    without knowing what it checks could drop one this concern was never meant to drop."""
    if "_check_sanity" not in vars(cls):
        return False
    try:
        return _PADDLE_MSG in inspect.getsource(orig)
    except (OSError, TypeError) as exc:
        raise _SourceUnreadable(f"{type(exc).__name__}: {exc}") from exc


def apply(config, patcher) -> None:
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel as pp
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    from ...registry.patching import PatchSignatureError

    # Two stages are only safe with the parity-ordered p2p of .p2p (see the docstring).
    if not _p2p_patched(patcher, p2p):
        raise RuntimeError("paddle_hybrid.dygraph.cpu.virtual_pipeline needs the .p2p patches applied first "
                           "(CONCERNS order).")
    targets = []
    for cls_name, min_acc in (("PipelineParallelWithInterleave", 2), ("PipelineParallelWithInterleaveFthenB", 0)):
        cls = patcher.require(pp, cls_name, "meta_parallel.pipeline_parallel")
        orig = patcher.require(cls, "_check_sanity", cls_name)
        patcher.check_params(orig, ["self"], f"{cls_name}._check_sanity")
        try:
            holds = _holds_assertion(cls, orig)
        except _SourceUnreadable as why:
            warnings.warn(
                f"paddle_hybrid.dygraph.cpu.virtual_pipeline: cannot read the source of {cls_name}._check_sanity "
                f"({why}), so cannot confirm it holds only the check {_PADDLE_MSG!r} this concern lifts; "
                "nothing replaced: a virtual pipeline with two stages stays refused by Paddle (use pp > 2). "
                "The other CPU/gloo patches are installed.", RuntimeWarning, stacklevel=2)
            return
        if not holds:
            raise PatchSignatureError(
                f"paddle_hybrid.dygraph.cpu: {cls_name}._check_sanity does not hold the check {_PADDLE_MSG!r} "
                "this patch replaces; unexpected Paddle. Set PADDLE_HYBRID_CPU=off to run "
                "without the CPU/gloo patches.")
        targets.append((cls, cls_name, orig, min_acc))
    for cls, cls_name, orig, min_acc in targets:  # all checked before the first change
        patcher.set(cls, "_check_sanity", _make_check_sanity(orig, cls_name, min_acc))
