"""A virtual pipeline in the dry run: ``examples/gpt_pp.py`` at pp3 x vp2 (3 ranks, 6 layers: one a chunk;
Paddle's interleaved schedule needs 3 stages or more).

- The interleaved schedule's first stage takes its second chunk's input from the last stage, whose run
  comes after it: the dry run runs it again once the later stages have run, and the whole schedule goes
  through (seen failing first, at pp4: exit 2, "rank 0 receives an integer tensor [1] from rank 3, whose
  run was not recorded before this one").
- A microbatch's activations are a whole microbatch's, not a chunk's: the probe counts a backward call
  a chunk (seen failing first, at pp4: 165120 bytes a microbatch on stage 0 where its layers save 330240).
- The GPU estimate finds attention's tensors exactly: gpt_pp (matmul attention, no dropout) saves one
  ``[b, heads, s, s]`` float32 tensor a layer (softmax's output, which the next matmul saves too: one
  storage), so a stage's square bytes a microbatch are its layers x 4 x b x heads x s^2; the estimate
  drops them and halves the float32 rest.  Seen failing first: with the probe's square test taking
  3-dimensional tensors too, every ``[b, s, h]`` activation of this model (s = h) counted as attention.
- ``--measure-microbatches 1`` measures the stage's layers as one chunk (the interleaved schedule cannot run
  one microbatch) and composes the in-flight count for two: every figure a whole run gives (parameters,
  gradients, optimizer state, activations a microbatch, in flight, the composed peak) equals it.
- Paddle's interleaved schedule's own limits are configuration errors before any rank runs: fewer than 3
  stages, fewer than twice the stages in microbatches.
"""
import json
import os
import subprocess
import sys

import pytest

# CI's 3.2.2 lane only (tests/conftest.py): the fake world against the real run, both on the lane's Paddle
# (both lanes passed it when it moved there, to keep the 3.3.1 lane, which carries PaddleFormers, in budget)
pytestmark = pytest.mark.one_lane

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
B, HEADS, S, STAGES, LAYERS = 2, 4, 32, 3, 6
ARGS = ["--pp", str(STAGES), "--vp", "2", "--steps", "2", "--layers", str(LAYERS), "--hidden", "32", "--heads",
        str(HEADS), "--seq-len", str(S), "--micro-batch-size", str(B), "--accumulate-steps", "6", "--corpus-chars",
        "20000"]
SAME = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes_per_microbatch",
        "in_flight_microbatches", "composed_peak_bytes")


def _dryrun(tmp_path, name, *extra, args=ARGS):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    report = str(tmp_path / f"{name}.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node",
                           str(STAGES), "--work", str(tmp_path / name), "--json", report, *extra, GPT, *args, "--out-dir",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=900)
    result = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    if os.path.isfile(report):
        with open(report) as f:
            result["report"] = json.load(f)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("dryrun_vp")
    return {"whole": _dryrun(work, "whole"), "one": _dryrun(work, "one", "--measure-microbatches", "1")}


def test_the_interleaved_schedule_runs_through(runs):
    whole = runs["whole"]
    assert whole["returncode"] == 0, whole["stdout"][-3000:] + whole["stderr"][-3000:]
    assert "(again, round 1: the stages it receives from have run)" in whole["stderr"]
    assert "round 2" not in whole["stderr"]
    assert whole["report"]["degrees"]["virtual_pipeline"] == 2
    assert [c["microbatches"] for c in whole["report"]["rank_classes"]] == [6] * STAGES


def test_one_chunk_measured_equals_the_whole_schedule(runs):
    whole, one = runs["whole"]["report"], runs["one"]
    assert one["returncode"] == 0, one["stdout"][-3000:] + one["stderr"][-3000:]
    one = one["report"]
    assert one["measured_virtual_stages"] == 1 and one["degrees"]["virtual_pipeline"] == 2
    assert any("virtual pipeline measured as one chunk" in note for note in one["notes"])
    for a, b in zip(whole["rank_classes"], one["rank_classes"]):
        assert a["class"] == b["class"]
        for key in SAME:
            assert a[key] == b[key], (a["class"], key, a[key], b[key])
    # stage 0 of 3 with 2 chunks and 6 microbatches: (3-0-1)*2 + (2-1)*(6 % 3 + 3) + 1 = 8 chunk forwards
    assert one["rank_classes"][0]["in_flight_microbatches"] == 4.0


def test_the_gpu_estimate_drops_exactly_attention_s_tensors(runs):
    assert "GPU estimate (not measured)" in runs["whole"]["stdout"]
    for entry in runs["whole"]["report"]["rank_classes"]:
        by_kind = entry["activations_by_kind_per_microbatch"]
        assert by_kind["square:float32"] == (LAYERS // STAGES) * 4 * B * HEADS * S * S, (entry["class"], by_kind)
        assert sum(by_kind.values()) == entry["activations_bytes_per_microbatch"]
        gpu = entry["gpu_estimate"]
        assert gpu["activations_bytes_per_microbatch"] == by_kind["other:float32"] // 2 + by_kind.get("other:int64", 0)
        assert gpu["device_bytes"] == 80 * 10**9 and gpu["headroom_bytes"] == 80 * 10**9 - gpu["composed_peak_bytes"]


@pytest.mark.parametrize("change, field, words", [
    (["--pp", "2", "--layers", "4"], "virtual pipeline", "needs 3 stages or more"),
    (["--accumulate-steps", "4"], "microbatches", "at least 2 x 3 = 6"),
])
def test_the_interleaved_schedule_s_limits_are_named_before_any_run(tmp_path, change, field, words):
    args = list(ARGS)
    for flag, value in zip(change[::2], change[1::2]):
        args[args.index(flag) + 1] = value
    nprocs = int(args[args.index("--pp") + 1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    report = str(tmp_path / "r.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node",
                           str(nprocs), "--json", report, GPT, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    with open(report) as f:
        errors = json.load(f)["errors"]
    assert [e["field"] for e in errors] == [field] and words in errors[0]["message"], errors
    assert not os.path.exists(tmp_path / "probes")
