"""PaddleFormers' auto-parallel Trainer (``--enable_auto_parallel 1``, Paddle's fused FSDP) through
examples/paddleformers_trainer.py, launched as test_trainer.py launches it: losses against one
process and the fleet path; the trained weights read after ``train()`` and saved; checkpoints
resumed on the auto path, in one process and on fleet TP2.

Every auto-parallel run goes through ``worker_trained_weights.py``: after training it reads every
parameter with ``numpy()`` on each rank and calls ``trainer.save_model``.

Tolerances: losses at rtol 1e-5 as test_trainer.py.  Weights at atol 1e-6: with ``adam_epsilon``
1.0 an AdamW update is lr * g / (|g| + 1), so a gradient's rounding (the fused buffers reduce in
another order than fleet's data parallelism) moves a weight by about lr times it (seen: 1.5e-8),
where a defect moves it by a whole update (lr 0.1: 1e-2).
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from paddle_hybrid.testing import LaunchError
from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture: skip / fail / ok)
from test_trainer import LAYOUTS, ROOT, SCRIPT, _env, assert_losses, run, work  # noqa: F401  (fixture)

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_trained_weights.py")
AUTO = ["--enable_auto_parallel", "1"]
# AdamW divides by the gradients' own scale, so a gradient n times too large changes its step only
# through epsilon: with epsilon 1.0 (and a larger learning rate) the step depends on the scale.
SCALE_SENSITIVE = ["--adam_epsilon", "1.0", "--learning_rate", "0.1", "--save_strategy", "no"]
WEIGHT_ATOL = 1e-6


@pytest.fixture(scope="module")
def models(work):
    """The tiny LLaMA with tied embeddings (the work fixture's) and one with an output layer of its own."""
    untied = os.path.join(work["dir"], "tiny-llama-untied")
    subprocess.run([sys.executable, SCRIPT, "write-tiny-model", untied, "--untied"], env=_env(), check=True,
                   capture_output=True, timeout=300)
    return {"tied": work["model"], "untied": untied}


def trained(work, models, name, nprocs, flags, tie):
    """{"losses": {rank: {step: loss}}, "weights": {rank: {name: array}}, "dir": output dir} of a
    run through the wrapper (each run once per module)."""
    runs = work["runs"]
    if name not in runs:
        losses = run(work["dir"], name, nprocs, flags, models[tie], wrapper=WRAPPER)
        out = os.path.join(work["dir"], name)
        weights = {}
        for rank in range(nprocs):
            with np.load(os.path.join(out, f"weights.rank{rank}.npz")) as f:
                weights[rank] = {k: f[k] for k in f.files}
        runs[name] = {"losses": losses, "weights": weights, "dir": out}
    return runs[name]


def one_process(work, models, tie):
    return trained(work, models, f"one-{tie}-scaled", 1, SCALE_SENSITIVE, tie)


def auto_run(work, models, layout, tie):
    return trained(work, models, f"{layout}-{tie}-auto", 2, [*LAYOUTS[layout][1], *SCALE_SENSITIVE, *AUTO], tie)


def fleet_dp2(work, models, tie):
    return trained(work, models, f"dp2-{tie}-fleet", 2, [*LAYOUTS["dp2"][1], *SCALE_SENSITIVE], tie)


def assert_weights(got, reference, what):
    assert sorted(got) == sorted(reference), (what, sorted(set(got) ^ set(reference)))
    for name in sorted(reference):
        assert got[name].shape == reference[name].shape, (what, name, got[name].shape, reference[name].shape)
        np.testing.assert_allclose(got[name], reference[name], rtol=0, atol=WEIGHT_ATOL, err_msg=f"{what}: {name}")


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("tie", ["untied", "tied"])
@pytest.mark.parametrize("layout", ["dp2", "sharding2"])
def test_auto_parallel_trains_like_one_process(work, models, layout, tie):
    """Losses every step on every rank.  Seen failing first (untied DP2, gradient accumulation 2): step 1
    5.334 (Paddle's loaders read the dataset unshuffled), then step 2 4.775 where one process gives 4.932
    (Paddle's FSDP summed the ranks' gradients and lost a micro-batch, PaddleFormers summed the
    micro-batches'); tied: "DistTensor is not defined yet when `local_dims` method is called" before
    step 1 (Paddle's fused FSDP made two parameters of the tied one over one storage and freed it)."""
    got = auto_run(work, models, layout, tie)["losses"]
    assert_losses(got, one_process(work, models, tie)["losses"][0], [1, 2, 3, 4], f"{layout} auto-parallel, {tie}")


def test_fleet_dp2_trains_like_one_process(work, models):
    """The fleet path on the same flags: the reference of the weights below."""
    got = fleet_dp2(work, models, "untied")["losses"]
    assert_losses(got, one_process(work, models, "untied")["losses"][0], [1, 2, 3, 4], "DP2 (fleet)")


@pytest.mark.parametrize("tie", ["untied", "tied"])
@pytest.mark.parametrize("layout", ["dp2", "sharding2"])
def test_trained_weights_equal_the_fleet_path_on_every_rank(work, models, layout, tie):
    """``param.numpy()`` after ``train()``, every parameter on every rank, against fleet DP2's.  Seen
    failing first: every array of zero size (shape (64, 32, 0)), and with the read refused
    (fleet_fixes.empty_dist_read) EmptyDistTensorReadError; ``save_model`` then stopped on "DistTensor is
    not defined yet"."""
    got = auto_run(work, models, layout, tie)["weights"]
    reference = fleet_dp2(work, models, tie)["weights"][0]
    for rank in got:
        assert_weights(got[rank], reference, f"{layout} auto-parallel ({tie}), rank {rank}")


def test_saved_model_loads_in_one_process(work, models):
    """``trainer.save_model()`` of auto-parallel DP2, loaded by ``from_pretrained`` in a new process:
    the weights the ranks read, exactly."""
    run_ = auto_run(work, models, "dp2", "untied")
    dump = os.path.join(run_["dir"], "loaded.npz")
    code = ("import sys, numpy as np, paddle\n"
            "from paddleformers.transformers import AutoModelForCausalLM\n"
            "paddle.set_device('cpu')\n"
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype='float32')\n"
            "np.savez(sys.argv[2], **{n: p.numpy() for n, p in m.named_parameters()})\n")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(run_["dir"], "final"), dump], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(dump) as f:
        loaded = {k: f[k] for k in f.files}
    assert sorted(loaded) == sorted(run_["weights"][0])
    for name, value in run_["weights"][0].items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_auto_parallel_tensor_parallel_is_refused_on_cpu(work, models):
    """Stock: the plugin's CPU all-reduce got an auto-parallel DistTensor from fleet's TP layers and
    the ranks died of a segmentation fault with no message (past a one-rank FSDP group error)."""
    flags = [*LAYOUTS["tp2"][1], "--save_strategy", "no", *AUTO]
    with pytest.raises(LaunchError) as failure:
        run(work["dir"], "tp2-auto", 2, flags, models["tied"])
    text = str(failure.value)
    assert "AutoParallelLayoutError: --enable_auto_parallel 1 with --tensor_model_parallel_size 2" in text, text[-3000:]
    assert "Drop --enable_auto_parallel" in text


# --------------------------------------------------------------------------- checkpoints

# The Trainer's default AdamW (epsilon 1e-8): a resume with fresh moments is off at step 4 (checked below).
SAVE_AT_2 = ["--save_strategy", "steps", "--save_steps", "2", *LAYOUTS["dp2"][1]]
FLEX = ["--save_to_hf", "false", "--convert_from_hf", "false"]
FORMATS = {"hf": [], "flex": FLEX}  # PaddleFormers' default: Hugging Face safetensors


def saving_run(work, models, fmt):
    return trained(work, models, f"dp2-auto-saves-{fmt}", 2, [*SAVE_AT_2, *FORMATS[fmt], *AUTO], "untied")


def resumed(work, models, fmt, name, nprocs, flags):
    checkpoint = os.path.join(saving_run(work, models, fmt)["dir"], "checkpoint-2")
    return run(work["dir"], name, nprocs, [*flags, "--resume_from_checkpoint", checkpoint], models["untied"])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_auto_parallel_resume_continues_the_run(work, models, fmt):
    """A checkpoint of auto-parallel DP2 (step 2) resumed on the auto path: steps 3 and 4 as the
    uninterrupted run.  Seen failing first: the save stopped ("DistTensor is not defined yet"), and so did
    the resume, in ``model.sharded_state_dict()``; a stock Hugging Face checkpoint holds no optimizer
    state, and fresh moments give another step 4 (the test below)."""
    uninterrupted = saving_run(work, models, fmt)["losses"][0]
    got = resumed(work, models, fmt, f"dp2-auto-resumed-{fmt}", 2, [*SAVE_AT_2, *FORMATS[fmt], *AUTO])
    assert_losses(got, uninterrupted, [3, 4], f"auto-parallel DP2 resumed ({fmt})")


def test_the_resume_needs_the_optimizer_state(work, models):
    """What the test above would miss without the moments: fresh moments (the opt-out) give another step 4."""
    uninterrupted = saving_run(work, models, "hf")["losses"][0]
    got = resumed(work, models, "hf", "dp2-auto-resumed-fresh-moments", 2,
                  [*SAVE_AT_2, *AUTO, "--ignore_load_lr_and_optim", "true"])[0]
    assert abs(got[4] - uninterrupted[4]) > 1e-4, (got, uninterrupted)


def test_a_checkpoint_without_optimizer_state_is_refused(work, models):
    """A Hugging Face-format auto-parallel checkpoint without the optimizer state (stock PaddleFormers
    saves none): refused, naming the missing state and the opt-out, not resumed with fresh moments."""
    source = os.path.join(saving_run(work, models, "hf")["dir"], "checkpoint-2")
    stripped = os.path.join(work["dir"], "checkpoint-2-weights-only")
    shutil.copytree(source, stripped, dirs_exist_ok=True)
    shutil.rmtree(os.path.join(stripped, "optimizer_state"))
    with pytest.raises(LaunchError) as failure:
        run(work["dir"], "dp2-auto-weights-only", 2, [*SAVE_AT_2, *AUTO, "--resume_from_checkpoint", stripped],
            models["untied"])
    text = str(failure.value)
    assert "FusedFSDPStateError" in text and "no optimizer state (optimizer_state/)" in text, text[-3000:]
    assert "--ignore_load_lr_and_optim true" in text


@pytest.mark.parametrize("layout", ["one", "tp2"])
def test_auto_parallel_checkpoint_resumes_on_the_fleet_path(work, models, layout):
    """The flex checkpoint of auto-parallel DP2 resumed in one process and on fleet TP2: steps 3 and 4
    as the uninterrupted run (the per-parameter optimizer keys are the fleet path's)."""
    uninterrupted = saving_run(work, models, "flex")["losses"][0]
    nprocs, flags = (1, ["--per_device_train_batch_size", "2"]) if layout == "one" else LAYOUTS["tp2"]
    flags = [*flags, *FLEX, "--save_strategy", "steps", "--save_steps", "2"]
    got = resumed(work, models, "flex", f"{layout}-from-auto-flex", nprocs, flags)
    assert_losses(got, uninterrupted, [3, 4], f"{layout} resumed from auto-parallel DP2")
