"""A pipeline stage's tuple travels as one message (``paddle_hybrid.dygraph.cpu.p2p``, part 3):
a 2-stage fleet pipeline that hands on (hidden float32, a second float32 that needs its gradient,
int64 positions) trains bitwise equal with ``PADDLE_HYBRID_PIPELINE_FUSED_P2P`` on and off, losses
and parameters on both ranks, and the first stage sends fewer messages: per microbatch one forward
message instead of three, and the last stage one gradient message instead of two.

Seen on the way: Paddle's ``Tensor.view(dtype)`` of a slice reads from the start of the buffer,
not the slice's, so the receiver splits the message (``paddle.split``) before viewing each part;
with slices this test's losses were 1.9e33 then NaN."""
import os

import numpy as np

from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_pipeline_tuples.py")
STEPS, MICRO = 3, 2  # worker_pipeline_tuples.STEPS, MICRO


def _run(fused):
    results = launch(WORKER, nprocs=2, timeout=180, env={"PADDLE_HYBRID_PIPELINE_FUSED_P2P": "1" if fused else "0"})
    return {r["rank"]: r for r in results}


def test_tuples_as_one_message_train_bitwise_like_one_message_a_tensor():
    fused, plain = _run(True), _run(False)
    for rank in (0, 1):
        np.testing.assert_array_equal(fused[rank]["losses"], plain[rank]["losses"])
        assert fused[rank]["params"].keys() == plain[rank]["params"].keys() and fused[rank]["params"]
        for name, value in plain[rank]["params"].items():
            np.testing.assert_array_equal(fused[rank]["params"][name], value, err_msg=f"rank {rank} {name}")
    assert np.isfinite(plain[0]["losses"]).all()
    microbatches = STEPS * MICRO
    # the first stage's forward sends: 3 tensors a microbatch -> 1 message
    assert plain[0]["counts"]["send"] - fused[0]["counts"]["send"] == 2 * microbatches, (plain[0], fused[0])
    # the last stage's gradient sends: 2 tensors need a gradient -> 1 message
    assert plain[1]["counts"]["send"] - fused[1]["counts"]["send"] == microbatches, (plain[1], fused[1])
