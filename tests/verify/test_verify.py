"""``python -m paddle_hybrid.verify``: says "equal" for layouts that train like one process, and for
each silent defect built into ``fleet_script.py`` says "DIFFERS", exits 1 and names the parameter
and what it saw.  The defects finish with a plausible loss and no error without the verifier
(``test_replica_check.py`` runs them unchecked); a layout whose run fails exits 2 with its log.

Tolerance: the verifier's default (rtol 1e-5, atol 1e-6); seen for the healthy layouts: losses
within 1e-7, parameters within 2e-6 of the tensor's scale (fleet script) and 1e-4 (gpt_pp.py,
3 AdamW steps)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "fleet_script.py")
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")


def verify(tmp_path, layouts, script, *args):
    out = tmp_path / "verdict.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify", "--layouts", layouts, "--json", str(out),
                           script, *args], env=env, capture_output=True, text=True, timeout=900)
    verdict = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, verdict


def test_healthy_fleet_layouts_are_equal(tmp_path):
    code, text, verdict = verify(tmp_path, "tp2,dp2", SCRIPT)
    assert code == 0, text
    assert all(v["equal"] for v in verdict["layouts"].values()) and set(verdict["layouts"]) == {"tp2", "dp2"}
    assert "tp2          equal" in text and "dp2          equal" in text


@pytest.mark.parametrize("defect, finding", [
    ("sized_per_rank", "gate: sized per rank but not marked distributed: [8] on each of the 2 tensor-parallel "
                       "ranks, [16] in one process"),
    ("partial_grad", "scale: differs within the tensor-parallel group [0, 1] after step 1"),
])
def test_a_silent_defect_is_named(tmp_path, defect, finding):
    code, text, verdict = verify(tmp_path, "tp2", SCRIPT, "--defect", defect)
    assert code == 1, text
    layout = verdict["layouts"]["tp2"]
    assert not layout["equal"] and any(f.startswith(finding) for f in layout["findings"]), layout["findings"]
    assert "tp2          DIFFERS" in text and finding in text


def test_gpt_pp_layouts_with_a_tied_embedding_are_equal(tmp_path):
    """examples/gpt_pp.py (its degree flags declared): PP2 (the embedding tied across the stages)
    and TP2 + sequence parallel, losses and parameters against one process."""
    code, text, verdict = verify(tmp_path, "pp2,sp2", GPT, "--steps", "3", "--layers", "2", "--hidden", "32",
                                 "--heads", "4", "--seq-len", "16", "--micro-batch-size", "4", "--accumulate-steps",
                                 "2", "--corpus-chars", "20000")
    assert code == 0, text
    assert all(v["equal"] and v["loss_diff"] < 1e-6 for v in verdict["layouts"].values()), verdict


def test_a_failed_run_exits_2_with_its_log(tmp_path):
    code, text, verdict = verify(tmp_path, "tp2", SCRIPT, "--defect", "no_such_defect")
    assert code == 2 and "FAILED" in text and "invalid choice" in text, text


def test_a_layout_that_cannot_split_the_batch_says_so(tmp_path):
    code, text, _ = verify(tmp_path, "dp3", GPT, "--steps", "1", "--micro-batch-size", "4")
    assert code == 2 and "--micro-batch-size 4 does not split over 3 data-parallel replicas" in text, text
