"""``--measure-microbatches``: each rank runs fewer microbatches than the script's schedule, and the
in-flight activations are composed with the script's own count (a model too large to run its whole
schedule on this machine).  ``examples/gpt_pp.py`` at pp2 with 4 microbatches a step, measured with 1:
stage 0 keeps 2 in flight (1F1B: stages - stage), stage 1 keeps 1; the activations of one microbatch
equal those of the full run's per-microbatch figure (same shapes), and are not zero (step 2, the step
measured, ran: ``--steps 2``)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
ARGS = ["--pp", "2", "--steps", "2", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
        "--micro-batch-size", "2", "--corpus-chars", "20000"]


def dryrun(tmp_path, name, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    report = str(tmp_path / f"{name}.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node", "2",
                           "--json", report, *extra[0], GPT, *ARGS, *extra[1], "--out-dir", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    return proc, report


def test_one_microbatch_measured_four_composed(tmp_path):
    full, full_report = dryrun(tmp_path, "full", [], ["--accumulate-steps", "4"])
    assert full.returncode == 0, full.stdout[-2000:] + full.stderr[-2000:]
    one, one_report = dryrun(tmp_path, "one", ["--measure-microbatches", "1"], ["--accumulate-steps", "4"])
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    with open(full_report) as f:
        full = json.load(f)
    with open(one_report) as f:
        one = json.load(f)
    assert one["schedule_microbatches"] == 4 and one["measured_microbatches"] == 1
    for a, b in zip(full["rank_classes"], one["rank_classes"]):
        # step 2 measured (issue 54: a script stopped after step 1 reported zeros): activations, and the
        # composed peak holds them beyond the parameters, gradients and optimizer state
        assert a["activations_bytes_per_microbatch"] > 0 and a["peak_window"] == "step 2"
        assert a["composed_peak_bytes"] > a["parameters_bytes"] + a["gradients_bytes"] + a["optimizer_bytes"]
        assert b["microbatches"] == 1 and a["microbatches"] == 4
        assert b["in_flight_microbatches"] == a["in_flight_microbatches"]
        assert b["activations_bytes_per_microbatch"] == a["activations_bytes_per_microbatch"]
        assert b["composed_peak_bytes"] == a["composed_peak_bytes"]
    assert [c["in_flight_microbatches"] for c in one["rank_classes"]] == [2, 1]


def test_the_schedule_must_be_on_the_command_line(tmp_path):
    proc, _ = dryrun(tmp_path, "none", ["--measure-microbatches", "1"], [])
    assert proc.returncode != 0
    assert "give them on its command line (gpt_pp.py: --accumulate-steps N)" in proc.stderr
