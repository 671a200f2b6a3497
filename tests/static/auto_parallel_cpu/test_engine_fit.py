"""Legacy auto-parallel ``Engine.fit`` on a 1 x 2 mesh on CPU over gloo, with reshard's deferred
sync on and off: every rank's losses and parameter shards equal one process (NumPy, float64;
rtol 1e-5 / atol 1e-6, float32 against float64), and the two settings give identical numbers."""
import functools
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch
from worker_engine import EPOCHS, H, LR, data, weights

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def run(deferred_sync):
    return launch(os.path.join(HERE, "worker_engine.py"), nprocs=2, timeout=240,
                  env={"PADDLE_HYBRID_RESHARD": "1" if deferred_sync else "0",
                       "PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT": "60"})


def reference():
    """One process: tanh(x W1) W2 + tanh(x W1) W3, mean squared error, SGD, the same batch each epoch."""
    x, y = (a.astype("float64") for a in data())
    w1, w2, w3 = (w.astype("float64") for w in weights())
    losses = []
    for _ in range(EPOCHS):
        h = np.tanh(x @ w1)
        diff = h @ w2 + h @ w3 - y
        losses.append(np.mean(diff ** 2))
        g = 2 * diff / diff.size
        gh = (g @ w2.T + g @ w3.T) * (1 - h ** 2)
        w1, w2, w3 = w1 - LR * (x.T @ gh), w2 - LR * (h.T @ g), w3 - LR * (h.T @ g)
    return np.array(losses), (w1, w2, w3)


@pytest.mark.parametrize("deferred_sync", [True, False])
def test_trains_like_one_process(deferred_sync):
    ref_losses, (w1, w2, w3) = reference()
    for r in run(deferred_sync):
        rank = r["rank"]
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        cols = slice(rank * H, (rank + 1) * H)  # this rank's shard of the split weights
        np.testing.assert_allclose(r["params"]["w1"], w1[:, cols], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["params"]["w2"], w2[cols, :], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["params"]["w3"], w3, rtol=1e-5, atol=1e-6)


def test_reshard_inserted_split_and_all_gather():
    for r in run(True):
        assert {"split", "all_gather"} <= set(r["reshard_ops"]), r["reshard_ops"]


def test_deferred_sync_changes_no_number():
    on, off = run(True), run(False)
    for a, b in zip(on, off):
        assert len(a["program"]) == len(b["program"]) > 0
        for k, (op_on, op_off) in enumerate(zip(a["program"], b["program"])):
            assert op_on == op_off, f"rank {a['rank']} op {k}: {op_on} != {op_off}"  # the same program
        assert a["losses"] == b["losses"]
        for name in a["params"]:
            np.testing.assert_array_equal(a["params"][name], b["params"][name])
