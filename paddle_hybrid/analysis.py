"""Static checks of rewritten programs."""
from __future__ import annotations

from paddle.base import framework

from .passes.pipeline_send_wait import execution_position, forward_sends, matching_backward_recv

__all__ = ["SendLifetimeError", "check_send_lifetimes"]


class SendLifetimeError(AssertionError):
    """A forward-sent variable may be freed before its send completes."""

    def __init__(self, var_name: str, detail: str):
        super().__init__(f"forward-sent variable {var_name!r} may be freed before its send completes: {detail}")
        self.var_name = var_name


def check_send_lifetimes(program) -> int:
    """Check every forward ``send_v2``/``partial_send`` of ``program``'s global block.

    "After" means in execution order (phase by phase: forward, backward,
    optimize; program order within a phase).  A send on the calculation stream
    (``use_calc_stream=True``) is complete when the next op runs.  A send on the
    communication stream needs either a ``c_sync_comm_stream`` reading the
    variable after the send, or an op reading the variable after the backward recv whose completion implies the send's
    (:func:`paddle_hybrid.passes.pipeline_send_wait.matching_backward_recv`):
    otherwise the variable's last use may be the send itself and its memory
    can be reused while the send is still reading it.

    Returns the number of forward sends checked; raises
    :class:`SendLifetimeError` naming the first variable that fails.
    """
    if not isinstance(program, framework.Program):
        raise TypeError(f"check_send_lifetimes expects a legacy paddle.static.Program, got {type(program).__name__}.")
    block = program.global_block()
    sends = forward_sends(block)
    position = execution_position(block)
    for idx, op, name in sends:
        if op.has_attr("use_calc_stream") and op.attr("use_calc_stream"):
            continue
        after_send = [i for i in range(len(block.ops)) if position[i] > position[idx]]
        if any(block.ops[i].type == "c_sync_comm_stream" and name in block.ops[i].input_arg_names
               for i in after_send):
            continue
        recv_idx = matching_backward_recv(block, name)
        if recv_idx is None:
            raise SendLifetimeError(name, "the send is asynchronous, no c_sync_comm_stream waits for it and "
                                          "the program has no backward recv to imply its completion")
        if not any(position[i] > position[recv_idx] and name in block.ops[i].input_arg_names
                   for i in range(len(block.ops))):
            recv = block.ops[recv_idx]
            raise SendLifetimeError(name, f"no c_sync_comm_stream waits for the send and no op reads it after "
                                          f"the backward {recv.type} of {recv.output('Out')[0]!r} (op {recv_idx}); "
                                          "apply paddle_hybrid.passes.pipeline_send_wait or keep the sync")
    return len(sends)
