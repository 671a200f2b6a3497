"""What a section program becomes to execute on CPU over gloo, op for op.

The section program that fleet built (and the send-wait pass rewrote) is left as it is: it is
what :func:`paddle_hybrid.send_wait.check_send_lifetimes` checks.  A copy is lowered:

* ``send_v2`` / ``recv_v2`` (their CPU kernels only throw) become ``broadcast`` on the same ring.
  A pipeline ring joins exactly two ranks, sender first (fleet's ``_init_process_group`` makes
  ring rank 0 the pair's first stage, and ``PipelineOptimizer`` gives each direction between two
  stages its own ring), so a broadcast rooted at the sender *is* the point-to-point message: gloo
  sends the buffer from one rank to the other, in program order on that ring.  A recv first
  allocates its buffer (``fill_constant`` of ``out_shape``/``dtype``), because the receiving side
  of a broadcast writes into the shape it is given.
* ``c_sync_calc_stream`` / ``c_sync_comm_stream`` (no CPU kernel) are dropped: gloo collectives
  return when the data has been sent or received, so there is no stream to wait for.
* the send-wait keep-alive ``ph_nop(X)`` becomes ``assign(X) -> X``: the standalone executor
  builds a backward job only from ops it can build statically, which excludes custom ops; an
  in-place assign reads ``X`` at the same place, so ``X`` stays a variable the backward job needs
  and the forward job does not free it (what the keep-alive is for), and changes no value.

Why not custom ``ph_send``/``ph_recv`` ops over the gloo comm context: in Paddle 3.3.1
``GlooCommContext::Send/Recv`` and ``CommContextManager::Get`` are not exported from
``libpaddle.so``, so a custom op cannot reach the context the ring owns; a second gloo stack of
our own would duplicate the rendezvous.  ``broadcast`` is an existing CPU kernel on that context.
"""
from __future__ import annotations

from paddle.base import framework

from ..ops import NOP_IN, NOP_OP
from ..program_edit import OP_DEVICE_KEY, OP_ROLE_KEY, deferred_sync, op_role
from .rings import ring_size

__all__ = ["lower_for_gloo", "STREAM_SYNCS"]

STREAM_SYNCS = ("c_sync_calc_stream", "c_sync_comm_stream")


def _attrs(op) -> dict:
    attrs = {OP_ROLE_KEY: op_role(op)}
    if op.has_attr(OP_DEVICE_KEY):
        attrs[OP_DEVICE_KEY] = op.attr(OP_DEVICE_KEY)
    return attrs


def _check_pair_ring(op) -> None:
    ring = op.attr("ring_id")
    if ring_size(ring) != 2:
        raise NotImplementedError(
            f"paddle_hybrid.static_pipeline: {op.type} on ring {ring} of {ring_size(ring)} ranks; only the 2-rank "
            "rings fleet makes between pipeline neighbours are lowered to broadcast.")


def _lower_send(block, idx, op) -> int:
    _check_pair_ring(op)
    name = op.input("X")[0]
    root = 1 - op.attr("peer")  # the sender's own rank on the 2-rank ring
    attrs = dict(_attrs(op), ring_id=op.attr("ring_id"), root=root)
    block._remove_op(idx)
    block._insert_op(idx, type="broadcast", inputs={"x": [name]}, outputs={"out": [name]}, attrs=attrs)
    return idx


def _lower_recv(block, idx, op) -> int:
    _check_pair_ring(op)
    name = op.output("Out")[0]
    base = _attrs(op)
    fill = dict(base, shape=list(op.attr("out_shape")), dtype=op.attr("dtype"), value=0.0)
    cast = dict(base, ring_id=op.attr("ring_id"), root=op.attr("peer"))
    block._remove_op(idx)
    block._insert_op(idx, type="fill_constant", inputs={}, outputs={"Out": [name]}, attrs=fill)
    block._insert_op(idx + 1, type="broadcast", inputs={"x": [name]}, outputs={"out": [name]}, attrs=cast)
    return idx + 1


def _lower_keepalive(block, idx, op) -> int:
    names = op.input(NOP_IN)
    attrs = _attrs(op)
    block._remove_op(idx)
    for k, name in enumerate(names):
        block._insert_op(idx + k, type="assign", inputs={"X": [name]}, outputs={"Out": [name]}, attrs=attrs)
    return idx + len(names) - 1


def lower_for_gloo(section) -> framework.Program:
    """A lowered copy of ``section`` (see the module doc); ``section`` is not changed."""
    program = section.clone()
    block = program.global_block()
    with deferred_sync(block):
        idx = 0
        while idx < len(block.ops):
            op = block.ops[idx]
            if op.type in STREAM_SYNCS:
                block._remove_op(idx)
                continue
            if op.type in ("partial_send", "partial_recv", "partial_allgather"):
                raise NotImplementedError(
                    f"paddle_hybrid.static_pipeline: {op.type} (pipeline with tensor parallel) is not lowered for gloo.")
            if op.type == "send_v2":
                idx = _lower_send(block, idx, op)
            elif op.type == "recv_v2":
                idx = _lower_recv(block, idx, op)
            elif op.type == NOP_OP:
                idx = _lower_keepalive(block, idx, op)
            idx += 1
    return program
