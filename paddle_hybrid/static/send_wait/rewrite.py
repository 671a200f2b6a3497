"""Pipeline send-wait: stop waiting for forward sends, keep their data alive instead.

In a static pipeline section program (Paddle's ``PipelineOptimizer``, fleet
``strategy.pipeline``) stage ``s`` sends each boundary activation ``X`` forward
to stage ``s + 1`` and later receives ``X@GRAD`` back.  Stage ``s + 1`` can only
send ``X@GRAD`` after it received ``X``, so the completion of that backward
``recv`` implies the completion of the forward ``send`` (and, as stage ``s + 1``
receives every activation of a microbatch before it sends any gradient, so does
the completion of the stage's first backward recv).  Any wait for the
forward send is therefore unnecessary if ``X`` is kept alive until that recv:

* 1F1B: Paddle inserts ``c_sync_comm_stream(X)`` (attr ``pipeline_flag``) for
  each forward send; upstream's ``_optimize_forward_send_sync`` removes them and
  puts a built-in ``nop`` on every such ``X`` after the *first* backward recv.
* F-then-B: the forward send runs on the calculation stream
  (``use_calc_stream=True``): computation waits until the peer has received.
  Upstream leaves it so.

This pass, for both schedules and any number of stages, with or without
recompute:

1. removes every ``c_sync_comm_stream`` whose inputs are only forward-sent
   variables (and upstream's built-in ``nop`` keep-alives on them);
2. moves each forward ``send_v2``/``partial_send`` still on the calculation
   stream to the communication stream (``use_calc_stream=False``), preceded by
   ``c_sync_calc_stream(X)`` as 1F1B's sends are, so the send reads ``X`` after
   it is computed;
3. inserts the plugin's ``ph_nop(X)`` right after the backward recv whose
   completion implies the send's: the stage's first backward recv of a
   gradient of a forward-sent variable (stage ``s + 1`` receives all of a
   microbatch's activations in its forward phase, before it sends any gradient
   back; see :func:`matching_backward_recv`), as upstream's 1F1B rewrite does,
   with one ``ph_nop`` per variable.

A send with no such recv in the program (no backward, or the last stage) is
left as it is.  Applying the pass twice changes nothing.  All edits happen
inside :func:`paddle_hybrid.common.program_edit.deferred_sync`.

:class:`SendWaitPass` is the same as a Paddle pass (``ph_pipeline_send_wait``,
registered by :mod:`paddle_hybrid.static.registration`).  Whether a rewritten program
keeps every sent variable alive long enough is checked by
:func:`paddle_hybrid.static.send_wait.lifetimes.check_send_lifetimes`, which derives
the send/recv pairing on its own.
"""
from __future__ import annotations

import dataclasses

from paddle.base import framework
from paddle.distributed.passes.pass_base import PassBase, PassType

from ...ops import NOP_IN, NOP_OP, NOP_OUT
from ...common.program_edit import OP_DEVICE_KEY, OP_ROLE_KEY, OpRole, deferred_sync, op_role

__all__ = ["SendWaitResult", "apply_pipeline_send_wait", "forward_sends", "matching_backward_recv", "phase",
           "SendWaitPass", "PASS_NAME"]

PASS_NAME = "ph_pipeline_send_wait"
SEND_TYPES = ("send_v2", "partial_send")
RECV_TYPES = ("recv_v2", "partial_recv")


@dataclasses.dataclass
class SendWaitResult:
    """What :func:`apply_pipeline_send_wait` changed."""

    removed_syncs: list = dataclasses.field(default_factory=list)
    """Names of the variables whose ``c_sync_comm_stream`` was removed."""
    async_sends: list = dataclasses.field(default_factory=list)
    """Variables whose forward send was moved off the calculation stream."""
    removed_upstream_nops: int = 0
    """Upstream built-in ``nop`` keep-alives replaced by ``ph_nop``."""
    nops: list = dataclasses.field(default_factory=list)
    """``(variable, recv output)`` of each ``ph_nop`` inserted."""
    kept: list = dataclasses.field(default_factory=list)
    """Forward-sent variables left alone (no backward recv to wait on)."""

    @property
    def changed(self) -> bool:
        return bool(self.removed_syncs or self.async_sends or self.removed_upstream_nops or self.nops)


def phase(op) -> int:
    """0 forward, 1 backward, 2 optimize: a section worker runs a microbatch's
    ops phase by phase, each phase in program order, so program order alone is
    not execution order (``_mv_head_recv`` leaves backward ops between forward ones)."""
    role = op_role(op)
    if role & (int(OpRole.Optimize) | int(OpRole.LRSched)):
        return 2
    if role & int(OpRole.Backward):
        return 1
    return 0


def forward_sends(block) -> list:
    """``(index, op, variable name)`` of every forward send in ``block``."""
    return [(i, op, op.input("X")[0]) for i, op in enumerate(block.ops)
            if op.type in SEND_TYPES and phase(op) == 0]


def _gradient_of(name: str):
    """``"X@GRAD"`` (or ``"X@GRAD@RENAME..."``) -> ``"X"``; None for a name that is no gradient."""
    k = name.find("@GRAD")
    return name[:k] if k > 0 else None


def matching_backward_recv(block):
    """Index of the backward recv whose completion implies that every forward send of
    ``block`` completed, or None if there is none.

    It is the first backward recv (in program order, which within the backward phase is
    execution order) that receives the gradient of a variable this stage sends forward.  That
    message comes from stage ``s + 1``, which sends gradients only in its backward phase, after
    its forward phase received every activation of the microbatch; so its completion implies
    every forward send of the microbatch completed.  A backward-phase recv of anything else
    (a message from another peer) implies nothing about the forward sends.  It is also the
    earliest such point, so the variables are held no longer than needed.
    """
    sent = {name for _, _, name in forward_sends(block)}
    for i, op in enumerate(block.ops):
        if op.type in RECV_TYPES and phase(op) == 1 and any(_gradient_of(n) in sent for n in op.output_arg_names):
            return i
    return None


def _only_reads(op, names) -> bool:
    inputs = op.input_arg_names
    return bool(inputs) and all(n in names for n in inputs) and set(op.output_arg_names) <= set(inputs)


def _has_keepalive(block, recv_idx: int, var_name: str) -> bool:
    for op in block.ops[recv_idx + 1:]:
        if op.type == NOP_OP and var_name in op.input(NOP_IN):
            return True
        if op.type not in (NOP_OP,):
            return False
    return False


def apply_pipeline_send_wait(program) -> SendWaitResult:
    """Rewrite ``program`` (a legacy section program; its global block) in place.

    Returns a :class:`SendWaitResult`.  Raises ``TypeError`` for anything but a
    legacy ``Program``.
    """
    if not isinstance(program, framework.Program):
        raise TypeError(
            f"apply_pipeline_send_wait expects a legacy paddle.static.Program (a pipeline section "
            f"program), got {type(program).__name__}; build it under paddle.pir_utils.OldIrGuard().")
    block = program.global_block()
    result = SendWaitResult()
    sends = forward_sends(block)
    if not sends:
        return result
    with deferred_sync(block):
        served = set()  # forward-sent vars that get a keep-alive after their recv
        has_recv = matching_backward_recv(block) is not None
        for _, op, name in sends:
            if has_recv:
                served.add(name)
            else:
                result.kept.append(name)
        # 1. waits that only wait for forward sends, and upstream's keep-alives
        for idx in range(len(block.ops) - 1, -1, -1):
            op = block.ops[idx]
            if op.type == "c_sync_comm_stream" and _only_reads(op, served):
                result.removed_syncs.extend(op.input("X"))
                block._remove_op(idx)
            elif op.type == "nop" and _only_reads(op, served):
                result.removed_upstream_nops += 1
                block._remove_op(idx)
        # 2. forward sends on the calculation stream -> communication stream
        for idx, op, name in reversed(forward_sends(block)):  # inserting keeps earlier indices
            if name not in served or not op.has_attr("use_calc_stream") or not op.attr("use_calc_stream"):
                continue
            op._set_attr("use_calc_stream", False)
            prev = block.ops[idx - 1] if idx > 0 else None
            if not (prev is not None and prev.type == "c_sync_calc_stream" and prev.input("X") == [name]):
                attrs = {OP_ROLE_KEY: op_role(op)}
                if op.has_attr(OP_DEVICE_KEY):
                    attrs[OP_DEVICE_KEY] = op.attr(OP_DEVICE_KEY)
                block._insert_op(idx, type="c_sync_calc_stream", inputs={"X": [name]},
                                 outputs={"Out": [name]}, attrs=attrs)
            result.async_sends.insert(0, name)
        # 3. ph_nop right after the matching backward recv
        for _, op, name in forward_sends(block):
            if name not in served:
                continue
            recv_idx = matching_backward_recv(block)
            if _has_keepalive(block, recv_idx, name):
                continue
            recv = block.ops[recv_idx]
            attrs = {OP_ROLE_KEY: int(OpRole.Backward)}
            if recv.has_attr(OP_DEVICE_KEY):
                attrs[OP_DEVICE_KEY] = recv.attr(OP_DEVICE_KEY)
            block._insert_op(recv_idx + 1, type=NOP_OP, inputs={NOP_IN: [name]},
                             outputs={NOP_OUT: [name]}, attrs=attrs)
            result.nops.append((name, recv.output("Out")[0]))
    return result


class SendWaitPass(PassBase):
    """``ph_pipeline_send_wait``: :func:`apply_pipeline_send_wait` on each main program (a
    pipeline section program; the startup program is not touched).  It takes no attributes
    (any given raises); the :class:`SendWaitResult` of the last program is the context's
    attribute ``ph_pipeline_send_wait``."""

    name = PASS_NAME

    def _type(self):
        return PassType.COMM_OPT

    def _check_self(self):
        if self._attrs:
            raise ValueError(f"{PASS_NAME} takes no attributes, got {sorted(self._attrs)}.")
        return True

    def _check_conflict(self, other_pass):
        return True

    def _apply_single_impl(self, main_program, startup_program, context):
        context.set_attr(PASS_NAME, apply_pipeline_send_wait(main_program))
