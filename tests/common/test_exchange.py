"""The plugin's cross-rank exchanges (layout checks, the timeline's gather) go through the job's
store as JSON: nothing another rank sends is unpickled, a difference names the entry and the
ranks, and a rank that does not arrive is named when the deadline runs out.

Seen failing first: on the code before, the layout check and the timeline gathered with
``all_gather_object``, which unpickles (the worker's forbidden ``pickle.loads`` raised)."""
import os

from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_exchange.py")


def test_exchanges_are_plain_and_name_what_differs_and_who_is_missing():
    results = launch(WORKER, 2, timeout=180)
    for rank, out in enumerate(results):
        assert out["same"] == [[[0, "w", [4, 4], "float32"], [0, "b", [4], "float32"]]] * 2, (rank, out["same"])
        assert "entry 1 is [0, 'b', [4], 'float32'] on rank 0 but [0, 'b', [5], 'float32'] on rank 1" \
            in out["differs"], (rank, out["differs"])
        assert sorted(e["rank"] for e in out["timeline"]) == [0, 1]
    message, missing, seconds = results[0]["lonely"]
    assert missing == [1] and "waited 2 s for rank 1" in message and "PADDLE_HYBRID_TIMEOUT" in message
    assert 2 <= seconds < 5, seconds
