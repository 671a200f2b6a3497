"""The dry run of ``examples/moe_ep.py`` at EP4 (world 4, ``--ranks auto``) against the real 4-process run,
both with forced-balanced routing (the dry run switches it on for its ranks; the real run with
``PADDLE_HYBRID_BALANCED_ROUTING=1``) and the same probe.

The script makes no fleet topology, so its four ranks are one class, run by rank 0.  5 tokens a rank,
top-2 over 4 experts (one a rank): 10 choices, [3, 3, 2, 2] to the experts, the same on every rank, so
rank 0's expert receives 12 tokens and rank 2's 8.  Rank 0 (the representative) equals the real rank 0
exactly: parameter, gradient and optimizer bytes, activations, the peak within 2 %, the communication log
(operation, group, bytes, in call order) and the routing recorded; every other real rank holds the same
bytes and makes the same calls on the same groups, none moving more than rank 0 (the representative is
the class's heaviest: experts 0.. get the extra tokens).

Seen failing first: the dry run stopped in ``global_scatter`` (``FakeProcessGroup has no pybind11
conduit``: the token exchange went to gloo's C++ past the process group); the real run logged no token
all-to-all (the same exchange, past the probe's wrapped methods); with the fake world's all-to-all of
before (its input slot for slot) rank 0 received 10 token rows, not 12 (1280 bytes, not 1536), and saved
10024 bytes of activations, not 11304.
"""
import json
import os
import subprocess
import sys

import pytest

from paddle_hybrid.testing import launch
from test_fake_equals_real import SAME_PATH, _assert_holds, _assert_moves, _env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = os.path.join(ROOT, "examples", "moe_ep.py")
ARGS = ["--steps", "2", "--seq-len", "5", "--global-batch", "4"]
WORLD = 4
ROUTING = {"mode": "forced-balanced", "gate_calls": 2, "top_k": 2, "tokens_per_expert": [3, 3, 2, 2]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("dryrun_moe")
    real_dir = str(work / "real")
    launch(MOE, WORLD, args=ARGS, env={**SAME_PATH, "PADDLE_HYBRID_DRYRUN_PROBE": real_dir,
                                       "PADDLE_HYBRID_BALANCED_ROUTING": "1"},
           results=False, launcher="paddle_hybrid.launch", timeout=300)
    report = str(work / "dry.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node",
                           str(WORLD), "--work", str(work / "dry"), "--json", report, MOE, *ARGS],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    real = {}
    for rank in range(WORLD):
        with open(os.path.join(real_dir, f"probe.{rank}.json")) as f:
            real[rank] = json.load(f)
    with open(str(work / "dry" / "probes" / "probe.0.json")) as f:
        fake = json.load(f)
    with open(report) as f:
        return {"real": real, "fake": fake, "report": json.load(f), "stdout": proc.stdout}


def test_the_representative_equals_the_real_rank(runs):
    real, fake = runs["real"][0], runs["fake"]
    _assert_holds(real, fake, 0)
    _assert_moves(real, fake)
    assert fake["routing"] == real["routing"] == ROUTING
    tokens = [c for c in fake["communication"] if c["op"] == "all_to_all" and c["bytes"] > 32]
    assert tokens and {c["bytes"] for c in tokens} == {12 * 32 * 4, 10 * 32 * 4}  # received 12 rows, sent 10


def test_the_class_covers_the_world_and_says_routing_was_forced(runs):
    (only,) = runs["report"]["rank_classes"]
    assert only["ranks"] == list(range(WORLD)) and only["representative"] == 0
    assert only["routing"] == ROUTING
    assert "MoE routing forced-balanced in class pipe 0 sharding 0" in runs["stdout"]  # fleet data parallel: one stage


@pytest.mark.parametrize("rank", range(1, WORLD))
def test_no_rank_of_the_class_holds_or_moves_more_than_its_representative(runs, rank):
    real, representative = runs["real"][rank], runs["fake"]
    for key in ("parameters", "gradients", "optimizer", "microbatches"):
        assert real[key] == representative[key], (rank, key)
    assert real["activations_bytes_per_step"] <= representative["activations_bytes_per_step"]
    calls = [(c["op"], c["group"]) for c in real["communication"]]
    assert calls == [(c["op"], c["group"]) for c in representative["communication"]]
    assert all(r["bytes"] <= f["bytes"] for r, f in zip(real["communication"], representative["communication"]))
