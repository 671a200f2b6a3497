"""Same-host send/recv through shared memory (``paddle_hybrid.gloo.local_p2p``) against gloo's own
path (``PADDLE_HYBRID_LOCAL_P2P=0``) on the same messages: every received value bitwise equal to
gloo's and to what was sent (bytes are moved); what gloo refuses (a non-contiguous tensor) arrives
in place; sends are buffered (every rank sending first completes); a message of another length, a
peer that never sends and a peer that dies are named."""
import functools
import pickle
import os
import time

import numpy as np
import pytest

from paddle_hybrid.testing import LaunchError, launch

# the plugin's own shared-memory kernels against gloo; every layout test of both lanes also trains
# through them: one CI lane, tests/conftest.py
pytestmark = pytest.mark.one_lane

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_local_p2p.py")


@functools.lru_cache(maxsize=None)
def run(nprocs, shared, case="values", timeout_s="60"):
    env = {"PADDLE_HYBRID_LOCAL_P2P": "1" if shared else "0", "CASE": case, "PADDLE_HYBRID_TIMEOUT": timeout_s}
    return launch(WORKER, nprocs=nprocs, timeout=240, env=env)


def _message(kind, sender):
    import importlib.util

    spec = importlib.util.spec_from_file_location("worker_local_p2p", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.message(kind, sender)


def test_two_ranks_equal_gloo_bitwise_and_what_was_sent():
    on, off = run(2, True), run(2, False)
    for a, b in zip(on, off):
        rank, peer = a["rank"], 1 - a["rank"]
        for kind in ("f32_16", "f32_600000", "i64", "bool", "f16", "empty"):
            key = f"{kind}/{rank}<-{peer}"
            np.testing.assert_array_equal(a["values"][key], _message(kind, peer), err_msg=key)
            np.testing.assert_array_equal(a["values"][key], b["values"][key], err_msg=key)
        np.testing.assert_array_equal(a["values"][f"isend/{rank}<-{peer}"], _message("f32_16", peer))
        np.testing.assert_array_equal(a["values"][f"batch/{rank}<-{peer}"], _message("f32_16", peer))
        np.testing.assert_array_equal(b["values"][f"batch/{rank}<-{peer}"], _message("f32_16", peer))
        np.testing.assert_array_equal(a["values"][f"ring/{rank}<-{peer}"], _message("f32_16", peer))
        # gloo refuses a non-contiguous send; here it arrives, into every other row
        expected = np.zeros([6, 3], dtype="float32")
        expected[[1, 4]] = (np.arange(6, dtype="float32").reshape([3, 2]) + 10 * peer).T
        np.testing.assert_array_equal(a["values"][f"strided/{rank}<-{peer}"], expected)
        assert b["values"][f"strided/{rank}<-{peer}"].dtype.kind == "U"  # an error's name on gloo
        assert a["calls"] == {"send": 10, "recv": 10} and b["calls"] == {"send": 0, "recv": 0}


def test_three_ranks_and_a_group_of_two():
    on = run(3, True)
    for r in on:
        rank = r["rank"]
        prv = (rank - 1) % 3
        np.testing.assert_array_equal(r["values"][f"ring/{rank}<-{prv}"], _message("f32_16", prv))
    for rank in (1, 2):  # the group [1, 2]: group ranks 0 and 1
        np.testing.assert_array_equal(on[rank]["values"][f"sub/{rank}"], _message("i64", 3 - rank))
    np.testing.assert_array_equal(on[0]["values"]["f32_600000/0<-1"], _message("f32_600000", 1))


def test_a_message_of_another_length_is_refused_by_name():
    errors = run(2, True, "length")[1]["errors"]
    assert errors[0][0] == "LocalP2PLengthError"
    assert "rank 0 sent a message of 16 bytes to a receive of 20 bytes" in errors[0][1], errors[0][1]
    assert errors[1][0] == "LocalP2PLengthError" and "out of step" in errors[1][1], errors[1][1]


def test_a_peer_that_never_sends_is_named_at_the_deadline():
    r = run(2, True, "late", "3")[0]
    kind, message = r["error"]
    assert kind == "GlooTimeoutError" and "waiting for rank 1" in message and "PADDLE_HYBRID_TIMEOUT" in message
    assert 3 <= r["waited"] < 10


def test_a_peer_that_dies_is_named_at_once(tmp_path):
    started = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 of"):  # it saved no result: it exited first
        launch(WORKER, nprocs=2, timeout=240, keep_dir=str(tmp_path),
               env={"PADDLE_HYBRID_LOCAL_P2P": "1", "CASE": "dies", "PADDLE_HYBRID_TIMEOUT": "60"})
    assert time.monotonic() - started < 40  # not the 60 s deadline
    with open(tmp_path / "results" / "rank0.pkl", "rb") as f:
        result = pickle.load(f)
    kind, message = result["error"]
    assert kind == "GlooPeerLostError" and "lost rank 1" in message, message
