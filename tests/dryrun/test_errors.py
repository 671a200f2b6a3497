"""Configuration errors named before any rank runs (exit 1), and a script that fails in one rank class
named with the class and the ranks it stands for (exit 2).

The Trainer cases use ``examples/paddleformers_trainer.py`` with a ``config.json`` written here (the
checks read the model's configuration; nothing is loaded, nothing runs): each planted error is named
with its field, its values and the fix, and no rank was started (no ``rank0.log``).  Seen failing with
the checks switched off: rank 0 was started, ran PaddleFormers' loader on the 8B configuration and the
dry run ended with exit 2 ("the script failed in rank 0") instead of the named error.  The stage-1 case
was written with the class naming in place (not seen failing).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
STAGE_ERROR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stage_error_script.py")

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def dryrun(tmp_path, nnodes, nproc, script, args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    work, report = str(tmp_path / "work"), str(tmp_path / "report.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", str(nnodes), "--nproc_per_node",
                           str(nproc), "--work", work, "--json", report, script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    with open(report) as f:
        return proc, json.load(f), work


def model_dir(tmp_path, **changes):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA_8B, **changes}))
    return str(path)


# (planted change to the 8B config, nnodes, nproc, Trainer flags, field named, words of the message)
PLANTED = {
    "world": ({}, 16, 8, ["--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size", "4",
                          "--sharding_parallel_size", "3", "--gradient_accumulation_steps", "8"],
              "world", "make 96"),
    "heads": ({"num_attention_heads": 36}, 4, 8, ["--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size",
                                                 "4", "--gradient_accumulation_steps", "8"],
              "num_attention_heads", "num_attention_heads = 36 does not divide by tensor parallelism 8"),
    "kv_heads": ({"num_key_value_heads": 3}, 4, 8, ["--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size",
                                                   "4", "--gradient_accumulation_steps", "8"],
                 "num_key_value_heads", "num_key_value_heads = 3 and tensor parallelism 8"),
    "vocab": ({"vocab_size": 128258}, 4, 8, ["--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size", "4",
                                             "--gradient_accumulation_steps", "8"],
              "vocab_size", "vocab_size = 128258 does not divide by tensor parallelism 8"),
    "layers": ({"num_hidden_layers": 30}, 4, 8, ["--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size",
                                                 "4", "--gradient_accumulation_steps", "8"],
               "num_hidden_layers", "num_hidden_layers = 30 does not divide by 4 stages"),
    "empty_stage": ({"num_hidden_layers": 3}, 4, 8, ["--tensor_model_parallel_size", "8",
                                                     "--pipeline_model_parallel_size", "4",
                                                     "--gradient_accumulation_steps", "8"],
                    "num_hidden_layers", "a chunk would have no layer"),
    "microbatches": ({}, 4, 8, ["--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size", "4",
                                "--gradient_accumulation_steps", "2"],
                     "gradient_accumulation_steps", "gradient_accumulation_steps = 2 microbatches for 4 pipeline stages"),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_a_planted_configuration_error_is_named_before_any_rank_runs(tmp_path, case):
    changes, nnodes, nproc, flags, field, words = PLANTED[case]
    model = model_dir(tmp_path, **changes)
    proc, report, work = dryrun(tmp_path, nnodes, nproc, TRAINER,
                                ["--model_name_or_path", model, "--output_dir", str(tmp_path / "out"), *flags])
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert [e["field"] for e in report["errors"]] == [field], report["errors"]
    assert words in report["errors"][0]["message"], report["errors"][0]["message"]
    assert f"configuration error: {field}: " in proc.stdout
    assert report["world"] == nnodes * nproc and report["rank_classes"] == []
    assert not os.path.exists(os.path.join(work, "rank0.log"))  # nothing ran


def test_the_eight_b_layout_passes_the_checks(tmp_path):
    """The real LLaMA-3-8B at tp8 x pp4 x dp4 has no configuration error (the checks do not cry wolf)."""
    from paddle_hybrid.dryrun import checks

    model = model_dir(tmp_path)
    args = ["--model_name_or_path", model, "--tensor_model_parallel_size", "8", "--pipeline_model_parallel_size", "4",
            "--gradient_accumulation_steps", "8"]
    degrees, errors = checks.check("trainer", args, None, 128, 16, 8)
    assert errors == [] and degrees["dp"] == 4, errors


def test_a_script_with_flags_gets_the_world_check(tmp_path):
    proc, report, _ = dryrun(tmp_path, 1, 8, GPT, ["--pp", "2", "--mp", "2", "--dp", "1"])
    assert proc.returncode == 1
    assert report["errors"][0]["field"] == "world" and "make 4" in report["errors"][0]["message"]


def test_a_failure_in_one_stage_names_its_class(tmp_path):
    proc, report, _ = dryrun(tmp_path, 1, 4, STAGE_ERROR, [])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "the script failed in rank 1, class pipe 1 sharding 0 (stands for ranks 1, 3)" in proc.stdout, proc.stdout
    assert "matmul" in proc.stdout or "Shape" in proc.stdout or "shape" in proc.stdout


MOE = os.path.join(ROOT, "examples", "moe_ep.py")
# A script's own sizes (its PADDLE_HYBRID_LAYOUT_FLAGS' heads, layers, seq_len, experts), as given or by its
# parser's default, against its degrees: (script, world, args, field, words).  Seen failing first: with these
# checks off, the dry run started rank 0 on each and the script stopped in it (the dry run's exit 2).
FLAGS_PLANTED = {
    "heads": (GPT, 4, ["--pp", "2", "--mp", "2", "--heads", "3", "--hidden", "96"], "--heads",
              "--heads = 3 does not divide by tensor parallelism 2"),
    "layers_by_default": (GPT, 3, ["--pp", "3"], "--layers", "--layers = 4 does not divide by 3 stages x 1 virtual"),
    "sequence_over_sep": (GPT, 2, ["--pp", "1", "--sep", "2", "--seq-len", "63"], "--seq-len",
                          "--seq-len = 63 does not divide by segment parallelism 2"),
    "experts": (MOE, 4, ["--moe-experts", "6"], "--moe-experts",
                "--moe-experts = 6 does not divide by expert parallelism 4"),
}


@pytest.mark.parametrize("case", list(FLAGS_PLANTED))
def test_a_script_s_own_sizes_are_checked_against_its_degrees(tmp_path, case):
    script, world, args, field, words = FLAGS_PLANTED[case]
    proc, report, work = dryrun(tmp_path, 1, world, script, args)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert [e["field"] for e in report["errors"]] == [field] and words in report["errors"][0]["message"], \
        report["errors"]
    assert not os.path.exists(os.path.join(work, "rank0.log"))


def test_expert_parallel_over_every_replica_by_default():
    """moe_ep's --ep defaults to every process: its data parallelism is what the world leaves, ep all of it."""
    from paddle_hybrid.common.script_kind import argument_defaults, script_flags
    from paddle_hybrid.dryrun import checks

    with open(MOE) as f:
        source = f.read()
    flags = script_flags(source)
    degrees, errors = checks.check("flags", [], flags, 4, 1, 4, argument_defaults(source, flags.values()))
    assert errors == [] and degrees["dp"] == 4 and degrees["ep"] == 4
