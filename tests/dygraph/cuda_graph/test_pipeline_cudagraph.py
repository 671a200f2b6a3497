"""PipelineLayer(use_cudagraph=True) on gloo ranks (emulation backend): the same
run with and without it gives equal losses and parameters on every rank."""
import os

import numpy as np

from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_pp_cudagraph.py")


def launch_pp(nprocs, args, env=None):
    return launch(WORKER, nprocs=nprocs, args=args, timeout=300, env=env)


def schedule_1f1b(pp, stage, acc):
    """(startup, microsteps) of one step of Paddle 3.3.1's 1F1B on ``stage``
    (PipelineParallel.forward_backward_pipeline)."""
    return min(pp - stage - 1, acc), acc


def schedule_interleaved(pp, vpp, stage, acc):
    """(startup, microsteps) of one step of Paddle 3.3.1's interleaved schedule
    on ``stage`` (PipelineParallelWithInterleave.forward_backward_pipeline)."""
    first_chunk_acc = acc % pp + pp
    return min((pp - stage - 1) * 2 + (vpp - 1) * first_chunk_acc, acc * vpp), acc * vpp


def expected_pairs(startup, microsteps, chunks=1):
    """Graph pairs each graphed layer of a stage holds after a step.

    Both schedules run ``startup`` forwards, then one forward and one backward
    until every microstep has had its forward, then the ``startup`` backwards
    left.  The pool's cycle ends when nothing is in flight, and the n-th forward
    of a layer in a cycle uses its pair n, so a layer needs as many pairs as it
    runs forwards in the longest cycle.  Each forward microstep runs every
    graphed layer of one of the ``chunks`` model chunks, and with more than one
    chunk ``startup`` > 0 (one cycle a step, in which each chunk runs the same
    number of forwards), so a layer's share is the cycle's forwards / ``chunks``.
    The same schedule every step replays the same pairs: no growth after step 1."""
    events = "F" * startup + "FB" * (microsteps - startup) + "B" * startup
    longest = forwards = in_flight = 0
    for event in events:
        forwards += event == "F"
        in_flight += 1 if event == "F" else -1
        if in_flight == 0:
            longest, forwards = max(longest, forwards), 0
    assert longest % chunks == 0, (events, chunks)
    return longest // chunks


def check_equal_to_eager(results, nprocs, pairs_of_stage):
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
        per_step = [pairs_of_stage(r["stage"])] * graphed["graphed"]
        assert graphed["pairs"] == [per_step] * len(graphed["losses"]), (where, graphed["pairs"])


def test_pp2_1f1b_equal_to_eager_and_upstream_defect_shown():
    results = launch_pp(2, ["--pp", "2", "--acc", "4", "--steps", "3", "--upstream", "1"],
                        env={"PADDLE_DEBUG_CUDAGRAPHEDLAYER_FALLBACK_TO_DEFAULT": "1"})
    check_equal_to_eager(results, 2, lambda stage: expected_pairs(*schedule_1f1b(2, stage, 4)))
    by_stage = {r["stage"]: r for r in results}
    # Worked out: stage 0 (2 graphed layers, split by the plain callable) never
    # drains within a step (startup 1: F FB FB FB B), so one pair per microbatch
    # of the step (4) although at most 2 are in flight; the last stage drains
    # after each microbatch (F B ...: 1).  Three steps, no growth.
    assert by_stage[0]["graphed"]["pairs"] == [[4, 4]] * 3
    assert by_stage[1]["graphed"]["pairs"] == [[1]] * 3
    # Paddle 3.3.1's wrapper on the same run: stage 0's first graphed run never
    # trains and its queue grows by one entry per microbatch.
    up = by_stage[0]["upstream"]
    assert [q[0] for q in up["queues"]] == [4, 8, 12]
    first_block = [k for k in sorted(up["params"]) if k.startswith("0.")]
    assert first_block and all(np.array_equal(up["params"][k], up["initial"][k]) for k in first_block)


def test_pp3_vp2_interleaved_equal_to_eager():
    results = launch_pp(3, ["--pp", "3", "--vpp", "2", "--acc", "6", "--layers", "12", "--steps", "3"])
    check_equal_to_eager(results, 3, lambda stage: expected_pairs(*schedule_interleaved(3, 2, stage, 6), chunks=2))
    for r in results:
        # Worked out: startup is 7, 5, 3 on stages 0-2 of 12 microsteps, so no
        # stage drains within a step: one pair per microbatch (6) per layer, every step.
        assert r["graphed"]["pairs"] == [[6] * r["graphed"]["graphed"]] * 3, r["graphed"]["pairs"]
