"""Same-host collectives through shared memory (``paddle_hybrid.gloo.local_ring``) against gloo's
own path (``PADDLE_HYBRID_LOCAL_RING=0``) on the same data.

Two ranks: every result bitwise equal to gloo's (a + b is gloo's sum for two ranks).  Three ranks:
the ranks hold bitwise the same values; integer sums, MAX and MIN equal gloo's; a float sum or
product is the parts combined in rank order (NumPy, exactly), within rtol = atol = 1e-6 of gloo's
ring order.
Waits: a rank that skips a collective is named at the deadline; a rank that dies is named at once."""
import functools
import os
import pickle
import time

import numpy as np
import pytest

from paddle_hybrid.testing import LaunchError, launch

# the plugin's own shared-memory kernels against gloo; every layout test of both lanes also trains
# through them: one CI lane, tests/conftest.py
pytestmark = pytest.mark.one_lane

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_local_ring.py")


@functools.lru_cache(maxsize=None)
def run(nprocs, ring, case="values", timeout_s="60"):
    env = {"PADDLE_HYBRID_LOCAL_RING": "1" if ring else "0", "CASE": case, "PADDLE_HYBRID_TIMEOUT": timeout_s}
    return launch(WORKER, nprocs=nprocs, timeout=240, env=env)


def test_two_ranks_equal_gloo_bitwise():
    on, off = run(2, True), run(2, False)
    assert on[0]["calls"] == {"all_reduce": 33, "reduce": 8, "broadcast": 6, "all_gather": 3}  # float16, slice: gloo
    assert off[0]["calls"] == {"all_reduce": 0, "reduce": 0, "broadcast": 0, "all_gather": 0}
    for a, b in zip(on, off):
        assert a["values"].keys() == b["values"].keys()
        for key, value in a["values"].items():
            np.testing.assert_array_equal(value, b["values"][key], err_msg=f"rank {a['rank']} {key}")
    assert on[0]["values"]["all_reduce/slice"].tolist() == [True]  # refused by gloo as before
    for r in on:  # uninstall unmaps the rings; the next all_reduce is gloo's (no new shared-memory call)
        assert r["rings_before_uninstall"] >= 1
        assert r["after_uninstall"] == {"rings": 0, "sum": [3.0, 3.0], "calls": 33}


def _part(shape, dtype, seed):
    return np.random.RandomState(seed).uniform(-2, 2, size=shape).astype(dtype)


def _parts(key, world):
    """The ranks' inputs of an all_reduce case, as the worker makes them."""
    _, _, dtype, size = key.split("/")
    size = int(size)
    rng = [np.random.RandomState(100 * r + size) for r in range(world)]
    if dtype.startswith("int"):
        return [g.randint(-50, 50, size=[size]).astype(dtype) for g in rng]
    return [g.uniform(-2, 2, size=[size]).astype(dtype) for g in rng]


def test_three_ranks_agree_and_sum_in_rank_order():
    on, off = run(3, True), run(3, False)
    for key, value in on[0]["values"].items():
        for r in on[1:]:
            np.testing.assert_array_equal(r["values"][key], value, err_msg=f"rank {r['rank']} {key}")
        gloo = off[0]["values"][key]
        if not key.startswith("all_reduce/") or "/float16/" in key or key == "all_reduce/slice":
            if key.startswith("sub/"):
                continue  # rank 0 holds none: checked below
            np.testing.assert_array_equal(value, gloo, err_msg=key)
            continue
        _, op, dtype, _ = key.split("/")
        parts = _parts(key, 3)
        expected = parts[0].copy()
        for p in parts[1:]:
            expected = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op](expected, p)
        np.testing.assert_array_equal(value, expected, err_msg=key)
        if dtype.startswith("int") or op in ("max", "min"):
            np.testing.assert_array_equal(value, gloo, err_msg=key)
        else:
            np.testing.assert_allclose(value, gloo, rtol=1e-6, atol=1e-6, err_msg=key)
    # the group of ranks 1 and 2: a broadcast from its last rank, global rank 2, reaches both
    for r in on[1:]:
        np.testing.assert_array_equal(r["values"]["sub/broadcast"], _part([5], "float32", 13))
        np.testing.assert_array_equal(r["values"]["sub/all_gather"], np.stack([_part([5], "float32", 13)] * 2))
        np.testing.assert_array_equal(r["values"]["sub/all_reduce"], off[r["rank"]]["values"]["sub/all_reduce"])


@pytest.mark.parametrize("nprocs", [2, 3])
def test_reduce_to_each_rank(nprocs):
    """The destination holds the parts combined in rank order (NumPy, exactly; for two ranks
    bitwise gloo's); every other rank keeps its own tensor (gloo leaves its scratch there)."""
    on, off = run(nprocs, True), run(nprocs, False)
    for key in on[0]["reduce"]:
        op, dtype, size, dst = key.split("/")
        combine = {"sum": np.add, "max": np.maximum, "prod": np.multiply}[op]
        expected = on[0]["reduce"][key][0]
        for r in on[1:]:
            expected = combine(expected, r["reduce"][key][0])
        for r in on:
            given, held = r["reduce"][key]
            if r["rank"] == int(dst):
                np.testing.assert_array_equal(held, expected, err_msg=key)
                gloo = off[r["rank"]]["reduce"][key][1]
                if nprocs == 2 or dtype == "int64":
                    np.testing.assert_array_equal(held, gloo, err_msg=key)
                else:
                    np.testing.assert_allclose(held, gloo, rtol=1e-6, atol=1e-6, err_msg=key)
            else:
                np.testing.assert_array_equal(held, given, err_msg=f"rank {r['rank']} {key}")


def test_a_rank_that_never_arrives_is_named_at_the_deadline():
    started = time.monotonic()
    results = run(3, True, "late", "3")
    for r in results[:2]:
        kind, message = r["error"]
        assert kind == "GlooTimeoutError" and "waiting for rank 2" in message and "PADDLE_HYBRID_TIMEOUT" in message
    assert time.monotonic() - started < 60


def test_a_rank_that_dies_is_named_at_once(tmp_path):
    started = time.monotonic()
    with pytest.raises(LaunchError, match="rank 2 of"):  # it saved no result: it exited first
        launch(WORKER, nprocs=3, timeout=240, keep_dir=str(tmp_path),
               env={"PADDLE_HYBRID_LOCAL_RING": "1", "CASE": "dies", "PADDLE_HYBRID_TIMEOUT": "60"})
    assert time.monotonic() - started < 40  # not the 60 s deadline
    for rank in (0, 1):
        with open(tmp_path / "results" / f"rank{rank}.pkl", "rb") as f:
            kind, message = pickle.load(f)["error"]
        assert kind == "GlooPeerLostError" and "lost rank 2" in message and "closed by peer" in message, message


def test_too_little_shared_memory_leaves_the_group_on_gloo():
    for r in run(2, True, "no_shm"):
        assert r["sum"] == [3.0, 3.0, 3.0] and r["calls"]["all_reduce"] == 0
        assert len(r["warnings"]) == 1 and "keeps gloo's TCP path" in r["warnings"][0], r["warnings"]
