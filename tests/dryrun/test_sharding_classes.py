"""Sharding stage 1's ranks of one pipeline stage: one run stands for all of them.

``examples/gpt_pp.py`` at pp2 x sharding2 (4 ranks) run for real with the probe, and dry-run with
``--ranks auto``: only each stage's sharding rank 0 runs; the classes of sharding rank 1 are derived
from that run and the partition its sharding optimizer made.  For every rank: the class's optimizer
state (bytes by dtype) equals the real rank's exactly, parameters and gradients too, and its
communication (operation, group, calls, bytes) equals the real rank's step.  The partition is uneven
here (the sharding ranks of a stage hold different optimizer state), so a class copied from its
stage's first rank would fail.

Seen failing first: before derivation, ``--ranks auto`` ran all four classes (the "ran" assertion);
with a derived class given its stage's first rank's optimizer state, the optimizer comparison failed
for rank 1; with its groups not moved to its own ranks, the communication comparison failed (rank 1's
pipeline pair is [1, 3], not [0, 2]).
"""
import json
import os
import subprocess
import sys

from paddle_hybrid.testing import launch
import pytest

# CI's 3.2.2 lane only (tests/conftest.py): how classes are derived does not depend on Paddle's version
pytestmark = pytest.mark.one_lane

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
ARGS = ["--pp", "2", "--sharding", "2", "--steps", "2", "--layers", "2", "--hidden", "48", "--heads", "4",
        "--seq-len", "32", "--micro-batch-size", "4", "--accumulate-steps", "2", "--corpus-chars", "20000"]
SAME_PATH = {"PADDLE_HYBRID_LOCAL_RING": "0", "PADDLE_HYBRID_LOCAL_P2P": "0", "PADDLE_HYBRID_AGREEMENT": "0"}


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _summary(probe):
    """A step's communication of a probe record, as the report sums it: {(op, group): (calls, bytes)}."""
    marks = probe["comm_marks"]
    out = {}
    for e in probe["communication"][marks[0]:marks[1]]:
        key = (e["op"], tuple(e["group"]) if e["group"] is not None else None)
        calls, nbytes = out.get(key, (0, 0))
        out[key] = (calls + 1, nbytes + e["bytes"])
    return out


def test_a_stage_s_sharding_ranks_are_derived_from_one_run(tmp_path):
    real_dir = str(tmp_path / "real")
    args = [*ARGS, "--out-dir", str(tmp_path / "out")]
    launch(GPT, 4, args=args, env={**SAME_PATH, "PADDLE_HYBRID_DRYRUN_PROBE": real_dir}, results=False,
           launcher="paddle_hybrid.launch", timeout=600)
    report_file = str(tmp_path / "dry.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node", "4",
                           "--work", str(tmp_path / "dry"), "--json", report_file, GPT, *args],
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(report_file) as f:
        report = json.load(f)
    ran = sorted(int(name.split(".")[1]) for name in os.listdir(tmp_path / "dry" / "probes"))
    classes = report["rank_classes"]
    assert sorted(r for c in classes for r in c["ranks"]) == [0, 1, 2, 3]
    derived = [c for c in classes if c["derived_from"] is not None]
    assert len(ran) == 2 and len(derived) == 2, (ran, [c["class"] for c in classes])
    real = {}
    for rank in range(4):
        with open(os.path.join(real_dir, f"probe.{rank}.json")) as f:
            real[rank] = json.load(f)
    stage0 = [real[r]["optimizer"] for r in range(4) if real[r]["topology"]["stage"] == 0]
    assert stage0[0] != stage0[1], "the partition should be uneven here, or the test could not fail"
    for entry in classes:
        (rank,) = entry["ranks"]
        mine = real[rank]
        assert entry["optimizer_by_dtype"] == {k: v for k, v in mine["optimizer"].items() if v}, (rank, entry)
        assert entry["parameters_by_dtype"] == mine["parameters"] and entry["gradients_by_dtype"] == mine["gradients"]
        got = {(c["op"], tuple(c["group"]) if c["group"] is not None else None): (c["calls"], c["bytes"])
               for c in entry["communication"]}
        assert got == _summary(mine), (rank, got, _summary(mine))
