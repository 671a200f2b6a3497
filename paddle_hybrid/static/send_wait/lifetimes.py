"""Is every forward-sent variable of a pipeline section program alive until its send completed?

A check of a program, not of the pass that produced it: nothing here comes from
:mod:`.rewrite`.  The checker has its own model of how a section program runs and of which
messages imply which, so a rewrite that puts a keep-alive after the wrong recv fails here even
if the rewrite is consistent with itself.

**Execution order** (Paddle's section worker).  Per microbatch, the ops whose role is ``Forward``
(or ``Forward|Loss``) run in program order, later the ops whose role is ``Backward`` (or
``Backward|Loss``), in program order; the ``Optimize``/``LRSched`` ops run once after every
microbatch.  A variable of a microbatch lives in that microbatch's scope, so "after" is: later
phase, or same phase and later in the program.  Ops with another role are not placed (they
cannot keep anything alive here).

**Completion of a send.**  A send with ``use_calc_stream=True`` is complete when the next op
runs.  One on the communication stream (ring ``r``) is complete

* after a ``c_sync_comm_stream`` of ring ``r`` on the variable, or
* after a recv of a message that the peer could only send after receiving the variable.  p2p
  rings are one per direction between two stages, so the checker finds the peer's way back from
  the program itself: a *return ring* of ``r`` is a ring on which this stage receives only
  gradients of variables it sends forward on ``r`` (``X@GRAD`` for an ``X`` sent on ``r``).  The
  peer computes such a gradient in its backward phase, after its forward phase received every
  activation of the microbatch; so any recv on a return ring, run after the send, implies the
  send completed.  A recv on any other ring (another peer, or activations coming in) implies
  nothing about it.

The variable is safe if a sync waits for the send, or some op reads it after a completion recv
(that read keeps its memory from being reused while the send still reads it).
"""
from __future__ import annotations

from paddle.base import framework

from ...common.program_edit import OpRole, op_role

__all__ = ["SendLifetimeError", "check_send_lifetimes"]

_SENDS = ("send_v2", "partial_send")
_RECVS = ("recv_v2", "partial_recv")
_FORWARD, _BACKWARD, _UPDATE = 0, 1, 2
_PHASE_OF_ROLE = {
    int(OpRole.Forward): _FORWARD,
    int(OpRole.Forward) | int(OpRole.Loss): _FORWARD,
    int(OpRole.Backward): _BACKWARD,
    int(OpRole.Backward) | int(OpRole.Loss): _BACKWARD,
    int(OpRole.Optimize): _UPDATE,
    int(OpRole.LRSched): _UPDATE,
}


class SendLifetimeError(AssertionError):
    """A forward-sent variable may be freed before its send completes."""

    def __init__(self, var_name: str, detail: str):
        super().__init__(f"forward-sent variable {var_name!r} may be freed before its send completes: {detail}")
        self.var_name = var_name


def _positions(block) -> dict:
    """Op index -> (phase, index) for every op the section worker runs; see the module doc."""
    out = {}
    for i, op in enumerate(block.ops):
        ph = _PHASE_OF_ROLE.get(op_role(op))
        if ph is not None:
            out[i] = (ph, i)
    return out


def _ring(op):
    return op.attr("ring_id") if op.has_attr("ring_id") else None


def _base_of_gradient(name: str):
    k = name.find("@GRAD")
    return name[:k] if k > 0 else None


def _return_rings(block, sent_on: dict) -> dict:
    """Send ring -> the rings on which this stage receives only gradients of variables it sends
    forward on that ring."""
    received: dict = {}  # recv ring -> every variable received on it
    for op in block.ops:
        if op.type in _RECVS:
            received.setdefault(_ring(op), []).extend(op.output_arg_names)
    out: dict = {}
    for ring, names in received.items():
        bases = {_base_of_gradient(n) for n in names}
        for send_ring, sent in sent_on.items():
            if names and bases <= sent:
                out.setdefault(send_ring, set()).add(ring)
    return out


def check_send_lifetimes(program) -> int:
    """Check every forward ``send_v2``/``partial_send`` of ``program``'s global block (a legacy
    pipeline section program) against the model of the module doc.

    Returns the number of forward sends checked; raises :class:`SendLifetimeError` naming the
    first variable that may be freed while its send still reads it.
    """
    if not isinstance(program, framework.Program):
        raise TypeError(f"check_send_lifetimes expects a legacy paddle.static.Program, got {type(program).__name__}.")
    block = program.global_block()
    pos = _positions(block)
    sends = [(i, op) for i, op in enumerate(block.ops)
             if op.type in _SENDS and pos.get(i, (None,))[0] == _FORWARD]
    sent_on: dict = {}
    for _, op in sends:
        sent_on.setdefault(_ring(op), set()).add(op.input("X")[0])
    return_rings = _return_rings(block, sent_on)
    for idx, op in sends:
        name, ring = op.input("X")[0], _ring(op)
        if op.has_attr("use_calc_stream") and op.attr("use_calc_stream"):
            continue
        later = [i for i in pos if pos[i] > pos[idx]]
        if any(block.ops[i].type == "c_sync_comm_stream" and _ring(block.ops[i]) == ring
               and name in block.ops[i].input_arg_names for i in later):
            continue
        completions = [i for i in later if block.ops[i].type in _RECVS
                       and _ring(block.ops[i]) in return_rings.get(ring, ())]
        if not completions:
            raise SendLifetimeError(name, f"the send on ring {ring} is asynchronous, no c_sync_comm_stream of that "
                                          "ring waits for it and there is no backward recv from its peer (no ring "
                                          "bringing back only gradients of what is sent on it) to imply its completion")
        first = min(completions, key=pos.get)
        if not any(pos[i] > pos[first] and name in block.ops[i].input_arg_names for i in pos):
            recv = block.ops[first]
            raise SendLifetimeError(
                name, f"no c_sync_comm_stream of ring {ring} waits for the send and no op reads it after op {first}, "
                      f"the {recv.type} of {recv.output('Out')[0]!r} on ring {_ring(recv)} from the send's peer "
                      "(the first recv whose completion implies the send's); apply "
                      "paddle_hybrid.static.send_wait.apply_pipeline_send_wait or keep the sync")
    return len(sends)
