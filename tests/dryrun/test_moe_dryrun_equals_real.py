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

Per class the experts it holds and the all-to-all bytes of step 2 (the report's ``experts``, a note per
class), at EP4 and EP2: the expert count (1, 2: one MoE layer of 4 experts), their parameters' bytes
(16768 an expert: up 32 x 64 + 64, down 64 x 32 + 32, float32) and the all-to-all bytes equal what the
real run's probe records on each rank (the probe finds the MoE layer above the gate that routed).
Seen failing first: before the report had them, ``experts`` was missing from the class entry (KeyError),
and the real probe's ``routing`` had no ``experts_held``.

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
EXPERT_BYTES = (32 * 64 + 64 + 64 * 32 + 32) * 4  # one Expert of moe_ep.py (hidden 32, ffn 64), float32


def _routing(record):
    """What the probe's ``routing`` says of the gates (its other keys are the experts')."""
    return {k: v for k, v in record["routing"].items() if k in ROUTING}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("dryrun_moe"), WORLD)


@pytest.fixture(scope="module")
def runs_ep2(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("dryrun_moe_ep2"), 2)


def _runs(work, world):
    real_dir = str(work / "real")
    launch(MOE, world, args=ARGS, env={**SAME_PATH, "PADDLE_HYBRID_DRYRUN_PROBE": real_dir,
                                       "PADDLE_HYBRID_BALANCED_ROUTING": "1"},
           results=False, launcher="paddle_hybrid.launch", timeout=300)
    report = str(work / "dry.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node",
                           str(world), "--work", str(work / "dry"), "--json", report, MOE, *ARGS],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    real = {}
    for rank in range(world):
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
    assert _routing(fake) == _routing(real) == ROUTING
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


@pytest.mark.parametrize("world", [4, 2])
def test_the_experts_held_and_their_all_to_all_equal_the_real_runs(request, world):
    """The class's experts (one MoE layer of 4 experts over ``world`` ranks) and the all-to-all bytes of its
    step 2, as the report gives them, against every real rank's probe; the table's note says them."""
    from paddle_hybrid.dryrun import report

    runs = request.getfixturevalue("runs" if world == WORLD else "runs_ep2")
    (entry,) = runs["report"]["rank_classes"]
    experts, local = entry["experts"], 4 // world
    assert experts["routing"] == "forced-balanced" and experts["moe_layers"] == 1
    assert experts["experts_per_layer"] == [local] and experts["experts_held"] == local
    assert experts["expert_parameters_bytes"] == local * EXPERT_BYTES
    for rank, real in runs["real"].items():  # every real rank holds as many, as large
        for key in ("moe_layers", "experts_per_layer", "experts_held", "expert_parameters_bytes"):
            assert real["routing"][key] == experts[key], (rank, key)
        exchanges = [c for c in report._communication(real) if c["op"] == "all_to_all"]
        moved = sum(c["bytes"] for c in exchanges)
        assert moved == experts["all_to_all_bytes"] if rank == 0 else moved <= experts["all_to_all_bytes"], rank
        assert sum(c["calls"] for c in exchanges) == experts["all_to_all_calls"], rank
    assert experts["all_to_all_bytes"] > 0
    line = f"{local} expert{'' if local == 1 else 's'} held ({local} a layer x 1 MoE layer), "
    assert line in runs["stdout"] and "routing forced-balanced" in runs["stdout"], runs["stdout"][-2000:]
    assert any(n.startswith("experts in class") and line in n for n in runs["report"]["notes"])
