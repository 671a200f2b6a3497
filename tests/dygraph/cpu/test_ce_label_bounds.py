"""TP2 ParallelCrossEntropy on CPU: a label outside the vocabulary raises on every rank, as
Paddle's kernel does (before the check: exit 0 and the loss silently the log-sum-exp); valid
labels and ignore_index give the one-process loss: against a float64 NumPy log-sum-exp of the
gathered logits, rtol 1e-5 (float32 exponentials summed in two partial sums of 8; their
rounding is ~1e-7 relative), atol 1e-7 where ignore_index gives 0."""
import os

import numpy as np

from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_ce_labels.py")


def _reference(logits, labels):
    logits = np.asarray(logits, dtype="float64")
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return [0.0 if y == -100 else lse[i] - logits[i, y] for i, y in enumerate(labels)]


def test_out_of_range_labels_raise_on_every_rank():
    results = launch(WORKER, 2, timeout=180)
    for rank, out in enumerate(results):
        assert "label 16" in out["too_large"] and "[0, 16)" in out["too_large"], (rank, out["too_large"])
        assert "label -1" in out["negative"] and "ignore_index (-100)" in out["negative"], (rank, out["negative"])
        np.testing.assert_allclose(out["valid"], _reference(out["full_logits"], [0, 9, 15]), rtol=1e-5)
        np.testing.assert_allclose(out["ignored"], _reference(out["full_logits"], [0, -100, 15]), rtol=1e-5,
                                   atol=1e-7)
