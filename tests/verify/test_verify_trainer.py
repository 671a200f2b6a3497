"""``python -m paddle_hybrid.verify`` on PaddleFormers' Trainer (``examples/paddleformers_trainer.py``,
the tiny LLaMA it writes), unchanged: the layout is the Trainer's own flags, the starting weights
its checkpoint.  TP2, DP2 (the Trainer's DP is sharding stage 1, so also the plugin's fused
sharding collectives) and group-sharded stage 3 (``--sharding stage3``) are equal to one process,
losses every step and every parameter at the verifier's default tolerance (rtol 1e-5, atol 1e-6).

Skipped on Paddle < 3.3, where PaddleFormers 1.2.0 cannot run; elsewhere a missing PaddleFormers
fails (CI installs it)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import paddle

    version = tuple(int(x) for x in paddle.__version__.split(".")[:2])
    if version != (0, 0) and version < (3, 3):  # 0.0: a develop build, taken as new
        pytest.skip(f"PaddleFormers 1.2.0 needs Paddle >= 3.3, this is {paddle.__version__}")
    model = str(tmp_path_factory.mktemp("verify_trainer") / "tiny-llama")
    subprocess.run([sys.executable, TRAINER, "write-tiny-model", model], check=True, capture_output=True,
                   env=_env(), timeout=300)
    return model


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_trainer_layouts_are_equal(tmp_path, tiny_llama):
    verdict_path = tmp_path / "verdict.json"
    proc = subprocess.run(
        [sys.executable, "-m", "paddle_hybrid.verify", "--layouts", "tp2,dp2,sharding2s3", "--json", str(verdict_path),
         TRAINER, "--model_name_or_path", tiny_llama, "--output_dir", "unused", "--device", "cpu", "--bf16", "false",
         "--fp16", "false", "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none",
         "--max_steps", "3", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
         "--max_grad_norm", "1.0", "--save_strategy", "no"],
        env=_env(), capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    verdict = json.loads(verdict_path.read_text())
    assert set(verdict["layouts"]) == {"tp2", "dp2", "sharding2s3"}
    for name, layout in verdict["layouts"].items():
        assert layout["equal"] and not layout["findings"], (name, layout)
    assert "tp2          equal" in text and "dp2          equal" in text
