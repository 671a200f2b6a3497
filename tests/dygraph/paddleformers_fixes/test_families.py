"""PaddleFormers 1.2's other model families through ``python -m paddle_hybrid.verify`` on the Trainer
example (tiny configs, 3 steps, clipping 1.0, accumulation 2): ERNIE-4.5 trains in TP2 and PP2,
Phi3 in TP2, equal to one process (ERNIE-4.5's PP2 stopped on its segmentation before
``paddleformers_fixes.pipe_models``: seen with ``PADDLE_HYBRID_PADDLEFORMERS_FIXES=0``, "weight_idxs'
length should be greater than 0"; Phi3's fused projections are compared in their own layout; its
PP2 was seen equal too); GPT-OSS and Gemma3 are refused in both, with the reason, where they
trained silently wrong (``families``, ``pipe_models``); Qwen3's and DeepSeek-V3's GPU-only imports
are stood in for (``paddlefleet_standins``)."""
import json
import os
import subprocess
import sys

import pytest

from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture)
from test_trainer import CPU_FLAGS, SCRIPT, _env

ARGS = [*CPU_FLAGS, "--max_steps", "3", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
        "--max_grad_norm", "1.0", "--save_strategy", "no"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, paddleformers_version):
    return str(tmp_path_factory.mktemp("families"))


def _model(models, family):
    path = os.path.join(models, family)
    if not os.path.isdir(path):
        subprocess.run([sys.executable, SCRIPT, "write-tiny-model", path, "--family", family], env=_env(), check=True,
                       capture_output=True, timeout=300)
    return path


def _verify(models, family, layouts):
    out = os.path.join(models, f"{family}-{layouts}.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify", "--layouts", layouts, "--json", out, SCRIPT,
                           "--model_name_or_path", _model(models, family), "--output_dir", "unused", *ARGS],
                          env=_env(), capture_output=True, text=True, timeout=900)
    with open(out) as f:
        return proc.returncode, proc.stdout + proc.stderr, json.load(f)


@pytest.mark.parametrize("family, layouts", [("ernie4_5", "tp2,pp2"), ("phi3", "tp2")])
def test_family_trains_like_one_process(models, family, layouts):
    code, text, verdict = _verify(models, family, layouts)
    assert code == 0, text[-4000:]
    assert all(v["equal"] and v["loss_diff"] < 1e-6 for v in verdict["layouts"].values()), verdict


def test_gpt_oss_is_refused_in_tp2_and_pp2(models):
    code, text, verdict = _verify(models, "gpt_oss", "tp2,pp2")
    assert code == 2 and set(verdict["failed"]) == {"tp2", "pp2"}, text[-3000:]
    assert "FamilyRefused: GPT-OSS with tensor parallelism (2)" in verdict["failed"]["tp2"], verdict["failed"]
    assert "PipeModelError: GptOssDecoderLayer" in verdict["failed"]["pp2"], verdict["failed"]


def test_gemma3_is_refused_in_tp2_and_pp2(paddleformers_version):
    """The same two refusals, asked of Gemma3's own config (what its layers and pipe are built
    with) in this process; the runs that showed them are in the note of issue 33."""
    from paddleformers.transformers import Gemma3TextConfig

    from paddle_hybrid.dygraph.paddleformers_fixes import families, pipe_models

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=8, intermediate_size=64)
    assert families.tensor_parallel_refusal("paddleformers.transformers.gemma3_text.modeling", config) is None
    config.tensor_model_parallel_size = 2
    refused = families.tensor_parallel_refusal("paddleformers.transformers.gemma3_text.modeling", config)
    assert str(refused).startswith("Gemma3 with tensor parallelism (2)")
    with pytest.raises(pipe_models.PipeModelError, match="sliding_attention"):
        pipe_models._check_sliding_window(config)


@pytest.mark.parametrize("module", ["paddleformers.transformers.qwen3.modeling",
                                    "paddleformers.transformers.deepseek_v3.modeling"])
def test_gpu_only_imports_are_stood_in_for(paddleformers_version, module):
    """paddlefleet / paddlefleet_ops (GPU-only, not on the package index) are stood in for while they are
    absent (``paddleformers_fixes.paddlefleet_standins``; the MoE families: test_moe_families.py): the
    model modules import.  Without the fixes they stop at the import."""
    code = f"import paddle_hybrid\nimport {module}"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stock = subprocess.run([sys.executable, "-c", code], env=dict(_env(), PADDLE_HYBRID_PADDLEFORMERS_FIXES="0"),
                           capture_output=True, text=True, timeout=300)
    assert stock.returncode != 0 and "paddlefleet" in stock.stderr, stock.stderr[-2000:]
