"""The dry run measures activations and the steady-state peak in the second optimizer step: a script that
stops before it is refused (exit 1, the flag and the value to give named), never reported with zeros.

Before the refusal (issue 54, item 2) ``gpt_pp.py --steps 1`` was reported with ``act/mb 0.0K``, a peak
of "(0 mb)" and a composed peak without activations, exit 0.  Two checks: the given value where the tool
knows the flag (gpt_pp's ``--steps`` through its ``PADDLE_HYBRID_LAYOUT_FLAGS``, a Trainer's
``--max_steps``), before any run; and, after each rank's run, the optimizer steps its probe saw (a script
that ends early whatever its flags say, a plain script).

Seen failing first, on the code before the refusal: every launch exited 0 with a table of ``act/mb 0.0K``
and peaks "(0 mb)" (gpt_pp at pp2 ran both ranks one step each); the Trainer's ``--max_steps 1`` gave no
configuration error; ``checks.too_few_steps`` did not exist.
"""
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
ONE_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "one_step_script.py")
TINY_GPT = ["--pp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--micro-batch-size",
            "2", "--accumulate-steps", "2", "--corpus-chars", "5000"]


def dryrun(tmp_path, nproc, script, args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    work, report = str(tmp_path / "work"), str(tmp_path / "report.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node",
                           str(nproc), "--work", work, "--json", report, script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    with open(report) as f:
        return proc, json.load(f), work


def test_gpt_pp_with_one_step_is_refused_before_any_run(tmp_path):
    proc, report, work = dryrun(tmp_path, 2, GPT, [*TINY_GPT, "--steps", "1", "--out-dir", str(tmp_path / "out")])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [e["field"] for e in report["errors"]] == ["--steps"], report["errors"]
    assert "give --steps 2 or more" in report["errors"][0]["message"]
    assert "configuration error: --steps: " in proc.stdout and "give --steps 2 or more" in proc.stdout
    assert report["rank_classes"] == []
    assert not os.path.exists(os.path.join(work, "rank0.log"))  # told at once: nothing ran


def test_a_script_that_ends_after_step_one_is_refused_after_its_run(tmp_path):
    """Given --steps 3 (the check before the run passes), it ends after its first step: its probe saw one."""
    proc, report, work = dryrun(tmp_path, 1, ONE_STEP, ["--steps", "3", "--stop-after", "1"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert os.path.exists(os.path.join(work, "rank0.log"))  # it ran
    assert report["rank_classes"] == [] and len(report["errors"]) == 1, report
    error = report["errors"][0]
    assert error["field"] == "--steps" and error["rank"] == 0, error
    assert "ended after 1 optimizer step" in error["message"] and "give --steps 2 or more" in error["message"]
    assert "it was given --steps 3" in error["message"], error["message"]
    assert "act/mb" not in proc.stdout  # no table


def test_a_plain_script_with_one_step_is_refused_after_its_run(tmp_path):
    plain = tmp_path / "plain_script.py"
    with open(ONE_STEP) as f:
        plain.write_text("".join(line for line in f if not line.startswith("PADDLE_HYBRID_LAYOUT_FLAGS")))
    proc, report, _ = dryrun(tmp_path, 1, str(plain), ["--steps", "1"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert report["rank_classes"] == [] and report["errors"][0]["field"] == "optimizer steps", report
    assert "ended after 1 optimizer step" in report["errors"][0]["message"]
    assert "run at least 2 optimizer steps" in report["errors"][0]["message"]
    assert "configuration error: optimizer steps: " in proc.stdout


def test_a_trainer_s_max_steps_1_is_a_configuration_error():
    from paddle_hybrid.dryrun import checks

    _, errors = checks.check("trainer", ["--max_steps", "1"], None, 1, 1, 1)
    assert [e.field for e in errors] == ["--max_steps"] and "give --max_steps 2 or more" in errors[0].message
    for given in ([], ["--max_steps", "2"], ["--max_steps", "-1"]):  # -1 (the default): the epochs decide
        assert checks.check("trainer", given, None, 1, 1, 1)[1] == [], given


def test_the_refusal_names_each_kind_s_flag():
    from paddle_hybrid.dryrun import checks

    flags = {"steps": "--steps"}
    assert "give --steps 2 or more" in checks.too_few_steps("flags", ["--steps", "1"], flags, None, 1)[1]
    field, message = checks.too_few_steps("trainer", ["--max_steps", "5"], None, None, 0)
    assert field == "--max_steps" and "ended after 0 optimizer steps" in message and "--max_steps 5" in message
    field, message = checks.too_few_steps("fleet", [], None, None, 1)
    assert field == "optimizer steps" and "run at least 2 optimizer steps" in message
