"""The timeline recorded from real fleet pipelines on gloo (examples/gpt_pp.py --timeline):
both files written on rank 0, the trace valid, one forward and one backward event per
microbatch (and chunk) per rank per step in the order fleet's schedule runs them, no two
compute events of one rank overlapping, and the bubble summary present."""
import json
import os

import numpy as np
import pytest

from paddle_hybrid.common.schedule import interleaved
from paddle_hybrid.testing import launch
from paddle_hybrid.dygraph.timeline import bubble, trace

SHORT = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--micro-batch-size", "2",
         "--corpus-chars", "20000", "--steps", "3", "--timeline"]

# fleet's 1F1B order for 2 stages and 4 microbatches: stage 0 warms up with one forward more
# than stage 1 (pp - stage - 1), then alternates, then drains the backwards
ONE_F_ONE_B_P2_M4 = {
    0: [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
    1: [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)],
}


def _run(repo_root, tmp_path, *flags):
    out = tmp_path / "out"
    res = launch(os.path.join(repo_root, "examples", "gpt_pp.py"), nprocs=2, timeout=300,
                 args=SHORT + ["--out-dir", str(out)] + list(flags))
    info = res[0]["summary"]["timeline"]
    assert os.path.isfile(info["trace"]) and os.path.isfile(info["png"])
    with open(info["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(info["trace"]) as f:
        obj = json.load(f)
    trace.validate_chrome_trace(obj)
    return info, obj


def _events_from_trace(obj):
    """The compute events back from the Chrome trace (what a user opens)."""
    out = []
    for e in obj["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("forward", "backward"):
            out.append({"rank": e["pid"], "step": e["args"]["step"], "cat": e["cat"], "name": e["cat"][0].upper(),
                        "micro": e["args"]["micro"], "chunk": e["args"]["chunk"], "start": e["ts"] / 1e6,
                        "end": (e["ts"] + e["dur"]) / 1e6})
    return out


# The bubble run: the example's default model size (hidden 128, sequence 128, 8 sequences per
# microbatch), so a microbatch's compute (~10 ms) outweighs a gloo p2p exchange and the
# measurement reflects the schedule; 6 steps, so the median over steps 1-5 (step 0 is warm-up)
# shrugs off a step in which the OS preempted a rank.
BUBBLE_RUN = ["--hidden", "128", "--seq-len", "128", "--micro-batch-size", "8", "--steps", "6"]

# Band for the median per-step bubble of each rank, PP=2, m=4: theory (p-1)/(m+p-1) = 20%.
# Measured on the shared 2-core machine (4 runs, 2 ranks, 5 steps each): per-rank medians
# 20-25%, single steps 14-43%.  It sits above the theory because on CPU gloo completes a p2p
# inside the call (no overlap: its time is idle for the rank); a rank can dip below it
# because the stages are not equal (the last holds the loss).  Under CI, whose two lanes
# share the 2 cores, three of five steps of one rank once measured 45% (median 43.9%).
# Band [theory / 2, 2.75 x theory] = [10%, 55%]: wide enough for that noise, yet a broken
# measurement fails: 0 (busy time taken for the whole window), 60% or more (a window
# spanning more than the step, lost events), 100% (a rank without compute).
BUBBLE_BAND = (0.5, 2.75)  # x theory


def _per_step(row):
    """The per-step measured bubbles of the summarised steps (JSON may have made keys str)."""
    per_step = {int(k): v["measured"] for k, v in row["per_step"].items()}
    return [per_step[int(s)] for s in row["steps"]]


def test_pp2_1f1b_timeline(repo_root, tmp_path):
    info, obj = _run(repo_root, tmp_path, "--pp", "2", "--accumulate-steps", "4", *BUBBLE_RUN)
    events = _events_from_trace(obj)
    for rank in (0, 1):
        for step in range(6):
            order = [(kind, micro) for kind, micro, _ in bubble.compute_order(events, rank, step)]
            assert order == ONE_F_ONE_B_P2_M4[rank], (rank, step, order)
    assert bubble.overlapping_compute(events) == []
    cats = {e.get("cat") for e in obj["traceEvents"] if e.get("ph") == "X"}
    assert {"forward", "backward", "comm", "grad_sync", "optimizer"} <= cats, cats
    s = info["bubble"]
    assert len(s) == 2, s.keys()
    theory = 1 / 5  # (p-1)/(m+p-1), p=2, m=4
    lo, hi = BUBBLE_BAND[0] * theory, BUBBLE_BAND[1] * theory
    for rank, row in s.items():
        assert row["theoretical"] == pytest.approx(theory)
        measured = _per_step(row)
        assert [int(x) for x in row["steps"]] == [1, 2, 3, 4, 5], row["steps"]  # step 0: warm-up, left out
        assert row["measured"] == pytest.approx(float(np.mean(measured)), abs=1e-12)
        median = float(np.median(measured))
        assert lo <= median <= hi, (f"rank {rank}: median measured bubble {median:.1%} (steps "
                                    f"{[f'{x:.1%}' for x in measured]}) outside [{lo:.0%}, {hi:.0%}] "
                                    f"around the theory {theory:.0%}")
        assert 0.0 <= row["comm_share"] < 1.0


def test_pp2_vp2_interleaved_timeline(repo_root, tmp_path):
    info, obj = _run(repo_root, tmp_path, "--pp", "2", "--vp", "2", "--accumulate-steps", "4")
    events = _events_from_trace(obj)
    for rank in (0, 1):
        for step in range(3):
            order = bubble.compute_order(events, rank, step)
            # every chunk runs microbatches 0..3 forward and backward, each exactly once, in order
            for kind in ("F", "B"):
                for chunk in (0, 1):
                    micros = [m for k, m, c in order if k == kind and c == chunk]
                    assert micros == [0, 1, 2, 3], (rank, step, kind, chunk, order)
            # a microbatch's backward on a chunk comes after its forward there
            pos = {(k, m, c): i for i, (k, m, c) in enumerate(order)}
            assert all(pos[("B", m, c)] > pos[("F", m, c)] for m in range(4) for c in (0, 1))
            # and action for action fleet's interleaved order (pp4 in tests/plan/test_simulate.py)
            assert order == interleaved(2, 4, 2, rank), (rank, step, order)
    assert bubble.overlapping_compute(events) == []
    row = info["bubble"][next(iter(info["bubble"]))]
    assert row["theoretical"] == pytest.approx(1 / (2 * 4 + 1))  # (p-1)/(v*m+p-1)
    assert np.isfinite(row["measured"])


def test_pp2_vp2_f_then_b_timeline(repo_root, tmp_path):
    """accumulate_steps < 2 x pp with VP: fleet's F-then-B schedule, every forward of the step
    before the first backward on every rank."""
    info, obj = _run(repo_root, tmp_path, "--pp", "2", "--vp", "2", "--accumulate-steps", "2")
    events = _events_from_trace(obj)
    for rank in (0, 1):
        for step in range(3):
            kinds = [k for k, _, _ in bubble.compute_order(events, rank, step)]
            assert kinds == ["F"] * 4 + ["B"] * 4, (rank, step, kinds)
    assert bubble.overlapping_compute(events) == []
