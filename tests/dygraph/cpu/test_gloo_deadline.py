"""Gloo groups obey PADDLE_HYBRID_TIMEOUT (2 gloo ranks, times scaled down from the user's case
of a 45 s pause against 30 s): a rank 4 s late passes with a deadline of 10 s and fails after
about 2 s with a deadline of 2 s, in a collective on the global group and in a p2p exchange on
a new group.

Seen failing first: before the deadline concern both groups held gloo's 30000 ms, and with
PADDLE_HYBRID_TIMEOUT=2 the late rank's operations still succeeded after 4 s.  The timeout's
message (``gloo_errors``): before it, gloo's own ``TIMEOUT self_rank = none pair_rank = -1``,
naming neither the rank nor the setting; the 3-rank test failed the same way."""
import os

import pytest

from paddle_hybrid.gloo import context_timeout as gloo_timeout
from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_deadline.py")

needs_gloo_timeout = pytest.mark.skipif(not gloo_timeout.available()[0], reason=str(gloo_timeout.available()[1]))


@needs_gloo_timeout
def test_a_late_rank_within_the_deadline_passes():
    results = launch(WORKER, 2, args=["--late", "4"], timeout=180, env={"PADDLE_HYBRID_TIMEOUT": "10"})
    for rank, out in enumerate(results):
        assert out["timeouts_ms"] == [10000, 10000], (rank, out)
        assert out["all_reduce"]["ok"] and out["p2p"]["ok"], (rank, out)
    assert 3.5 < results[0]["all_reduce"]["seconds"] < 8 and 3.5 < results[0]["p2p"]["seconds"] < 8, results[0]


@needs_gloo_timeout
def test_a_rank_later_than_the_deadline_fails_at_the_deadline():
    results = launch(WORKER, 2, args=["--late", "4"], timeout=180, env={"PADDLE_HYBRID_TIMEOUT": "2"})
    out = results[0]
    assert out["timeouts_ms"] == [2000, 2000], out
    for op, name in (("all_reduce", "all_reduce"), ("p2p", "recv")):
        error = out[op]["error"]
        assert not out[op]["ok"] and out[op]["type"] == "GlooTimeoutError", out
        assert out[op]["waited_for"] == [1], out
        assert error.startswith(f"paddle_hybrid: {name} on the gloo group of ranks [0, 1] timed out after 2 s"), error
        assert "(PADDLE_HYBRID_TIMEOUT) waiting for rank 1" in error and "TIMEOUT" in error.split("gloo:")[1], error
        assert 1.5 < out[op]["seconds"] < 3.5, out  # a group of two: the other rank is named at once


@needs_gloo_timeout
def test_a_hung_rank_of_three_is_named_by_the_ranks_that_waited():
    """Rank 2 of 3 reaches the all_reduce 6 s late with a deadline of 2 s: ranks 0 and 1 time out,
    learn from the job's store that only they did, and name rank 2 (after the naming window,
    half the deadline)."""
    results = launch(WORKER, 3, args=["--late", "6"], timeout=180, env={"PADDLE_HYBRID_TIMEOUT": "2"})
    for rank in (0, 1):
        out = results[rank]["all_reduce"]
        assert not out["ok"] and out["type"] == "GlooTimeoutError", (rank, out)
        assert out["waited_for"] == [2], (rank, out)
        assert "ranks [0, 1, 2] timed out after 2 s (PADDLE_HYBRID_TIMEOUT) waiting for rank 2" in out["error"], out
        assert 1.5 < out["seconds"] < 5.5, (rank, out)


@needs_gloo_timeout
def test_a_timeout_given_to_new_group_is_that_groups_deadline():
    """``new_group(timeout=timedelta(seconds=2))`` under PADDLE_HYBRID_TIMEOUT=10: that group waits
    2 s (the p2p of a rank 4 s late fails), the global group 10 s (its all_reduce passes).  Before,
    Paddle passed the timeout to no backend."""
    results = launch(WORKER, 2, args=["--late", "4", "--group-timeout", "2"], timeout=180,
                     env={"PADDLE_HYBRID_TIMEOUT": "10"})
    out = results[0]
    assert out["timeouts_ms"] == [10000, 2000], out
    assert out["all_reduce"]["ok"], out
    assert not out["p2p"]["ok"] and 1.5 < out["p2p"]["seconds"] < 3.5, out
    assert "(the timeout given to new_group) waiting for rank 1" in out["p2p"]["error"], out


def test_a_group_only_one_rank_creates_fails_at_the_deadline_naming_the_other():
    """Rank 0 calls ``new_group([0, 1])`` once more than rank 1 (PADDLE_HYBRID_TIMEOUT=3): its
    call ends after about 3 s with a TimeoutError naming rank 1 and the setting.  Seen failing
    first: rank 0 waited in the group's store rendezvous until the launch's 120 s ran out (Paddle's
    own bound is FLAGS_stop_check_timeout, 900 s)."""
    results = launch(WORKER, 2, args=["--late", "8", "--extra-group"], timeout=120,
                     env={"PADDLE_HYBRID_TIMEOUT": "3"})
    out = results[0]["new_group"]
    assert not out["ok"] and out["type"] == "TimeoutError", out
    assert "new_group (gloo group" in out["error"] and "of ranks [0, 1]) waited 3 s for rank 1" in out["error"], out
    assert "PADDLE_HYBRID_TIMEOUT" in out["error"], out
    assert 2.5 < out["seconds"] < 6, out


@needs_gloo_timeout
@pytest.mark.parametrize("nranks", [2, 3])
def test_a_peer_that_left_is_named_as_lost_not_as_a_timeout(nranks):
    """The last rank leaves before an all_reduce (deadline 60 s).  Gloo tells a survivor within
    milliseconds, either as TIMEOUT (the pair whose peer closed) or as "Connection reset by peer"
    (naming an address).  Every survivor raises ``GlooPeerLostError`` naming the rank that left:
    at once where gloo's error gives its place, else after the naming window (5 s), from which
    survivors reported the loss in the job's store.  Seen failing first: "timed out after 60 s ...
    waiting for rank N" 0.01 s after the death (with 3 ranks after the 5 s window), or gloo's reset
    message naming no rank."""
    results = launch(WORKER, nranks, args=["--late", "0", "--die"], timeout=180, env={"PADDLE_HYBRID_TIMEOUT": "60"})
    last = nranks - 1
    assert results[last] == {"left": True}
    for rank in range(last):
        out = results[rank]["all_reduce"]
        assert not out["ok"] and out["type"] == "GlooPeerLostError", (rank, out)
        assert out["peer"] == last, (rank, out)
        assert out["error"].startswith(f"paddle_hybrid: all_reduce on the gloo group of ranks "
                                       f"{list(range(nranks))} lost rank {last} after "), out["error"]
        assert "connection closed by peer" in out["error"], out
        assert "not a timeout (the deadline is 60 s, PADDLE_HYBRID_TIMEOUT)" in out["error"], out
        assert out["seconds"] < 10, (rank, out)  # the naming window at most, far from the deadline
