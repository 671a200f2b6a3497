"""PipelineLayer(use_cudagraph=True) on gloo ranks (emulation backend): the same
run with and without it gives equal losses and parameters on every rank."""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_pp_cudagraph.py")


def launch_pp(nprocs, args, env=None):
    return launch(WORKER, nprocs=nprocs, args=args, timeout=300, env=env)


def check_equal_to_eager(results, nprocs):
    assert sorted(r["rank"] for r in results) == list(range(nprocs))
    assert sorted(r["stage"] for r in results) == list(range(nprocs))
    for r in results:
        eager, graphed = r["eager"], r["graphed"]
        where = f"rank {r['rank']} (stage {r['stage']})"
        # Built by the plugin: graphed runs, plain callables eager, nothing of Paddle's wrapper.
        assert graphed["graphed"] >= 1 and graphed["upstream_graphed"] == 0, where
        assert eager["graphed"] == 0, where
        assert eager["kinds"].count("callable") == graphed["kinds"].count("callable"), where
        assert set(graphed["kinds"]) <= {"CUDAGraphedLayer", "callable"}, where
        assert graphed["one_pool"], where
        # Same numbers, exactly.
        assert graphed["losses"] == eager["losses"], where
        assert eager["params"].keys() == graphed["params"].keys()
        for k in eager["params"]:
            np.testing.assert_array_equal(graphed["params"][k], eager["params"][k], err_msg=f"{where} {k}")
            # every parameter trained, on stage 0 too
            assert not np.array_equal(graphed["params"][k], graphed["initial"][k]), f"{where} {k} never changed"
        # Nothing in flight after any step; graphs did not grow after step 1.
        assert all(q == 0 for step in graphed["queues"] for q in step), (where, graphed["queues"])
        assert graphed["in_flight"] == [0] * len(graphed["in_flight"]), where
        assert all(1 <= n for n in graphed["pairs"]), where


def test_pp2_1f1b_equal_to_eager_and_upstream_defect_shown():
    results = launch_pp(2, ["--pp", "2", "--acc", "4", "--steps", "3", "--upstream", "1"],
                        env={"PADDLE_DEBUG_CUDAGRAPHEDLAYER_FALLBACK_TO_DEFAULT": "1"})
    check_equal_to_eager(results, 2)
    by_stage = {r["stage"]: r for r in results}
    # Stage 0 has up to 2 microbatches in flight: one graph pair per microbatch
    # position of the step (4); the last stage drains after each microbatch (1).
    assert by_stage[0]["graphed"]["pairs"] == [4, 4]
    assert by_stage[1]["graphed"]["pairs"] == [1]
    # Paddle 3.3.1's wrapper on the same run: stage 0's first graphed run never
    # trains and its queue grows by one entry per microbatch.
    up = by_stage[0]["upstream"]
    assert [q[0] for q in up["queues"]] == [4, 8, 12]
    first_block = [k for k in sorted(up["params"]) if k.startswith("0.")]
    assert first_block and all(np.array_equal(up["params"][k], up["initial"][k]) for k in first_block)


def test_pp3_vp2_interleaved_equal_to_eager():
    results = launch_pp(3, ["--pp", "3", "--vpp", "2", "--acc", "6", "--layers", "12", "--steps", "3"])
    check_equal_to_eager(results, 3)
    for r in results:
        # Several microbatches in flight per chunk: one pair per microbatch position.
        assert r["graphed"]["pairs"] == [6] * r["graphed"]["graphed"], r["graphed"]["pairs"]
