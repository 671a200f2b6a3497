"""A section program whose backward phase first receives from the wrong peer (shared by the
pass's and the checker's tests)."""
from paddle_hybrid.static.send_wait import phase
from paddle_hybrid.testing.static_programs import build_pipeline_program


def with_foreign_backward_recv():
    """Stage 1 of 3 (1F1B, syncs kept) whose backward phase first receives a message from the
    *previous* stage (on the ring its activations come in on), then the gradients from the next
    stage.  Returns the program and the index of the foreign recv."""
    program = build_pipeline_program(1, stages=3, schedule="1F1B", branches=2, upstream_send_sync_opt=False)
    block = program.global_block()
    fwd_recv = next(op for op in block.ops if op.type == "recv_v2" and phase(op) == 0)
    first_bwd = next(i for i, op in enumerate(block.ops) if op.type == "recv_v2" and phase(op) == 1)
    var = block.create_var(name="foreign_msg", shape=[2, 8], dtype="float32")
    block._insert_op(first_bwd, type="recv_v2", outputs={"Out": [var]},
                     attrs={"ring_id": fwd_recv.attr("ring_id"), "peer": 0, "use_calc_stream": True,
                            "out_shape": [2, 8], "dtype": var.dtype, "op_role": 1})
    return program, first_bwd
