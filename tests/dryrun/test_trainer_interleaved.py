"""PaddleFormers' Trainer with a virtual pipeline (pp3 x vp2, the interleaved schedule run whole, not
``--measure-microbatches``) in the dry run against the real run, rank by rank: what each holds and
moves equal, as ``test_fake_equals_real.py`` checks for pp2.

The interleaved schedule's first stage takes its second chunk's input from the last stage, which
takes its first chunk's from the first: each waits on the other's record.  Seen failing first: the
first stage's second run stopped one fused pipeline message short (exit 2); with reruns in rounds
alone it needed 8 rounds (each rank went one message further a round).  Now the plugin's fused
pipeline message is declared a payload (its values decide no shape: the tuple's shapes came in the
stages' first exchange), so one rerun of the first stage suffices.
"""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fake_equals_real import (TRAINER, TRAINER_ARGS, _assert_holds, _assert_moves,  # noqa: E402
                                   _compare_runs, _env, paddleformers_version)  # noqa: F401  (the fixture)

INTERLEAVED = list(TRAINER_ARGS)
for flag, value in (("--tensor_model_parallel_size", "1"), ("--pipeline_model_parallel_size", "3"),
                    ("--gradient_accumulation_steps", "6"), ("--per_device_train_batch_size", "1")):
    INTERLEAVED[INTERLEAVED.index(flag) + 1] = value
INTERLEAVED += ["--virtual_pipeline_model_parallel_size", "2"]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, paddleformers_version):
    work = tmp_path_factory.mktemp("dryrun_interleaved")
    model = str(work / "tiny-llama")
    subprocess.run([sys.executable, TRAINER, "write-tiny-model", model], env=_env(), check=True, capture_output=True,
                   timeout=300)
    config_path = os.path.join(model, "config.json")  # 6 layers: one a virtual stage (built from the config)
    with open(config_path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 6
    with open(config_path, "w") as f:
        json.dump(config, f)
    return _compare_runs(work, TRAINER, 3, ["--model_name_or_path", model, "--output_dir", str(work / "out"),
                                            *INTERLEAVED])


@pytest.mark.parametrize("rank", range(3))
def test_the_interleaved_trainer_in_the_fake_world_equals_the_real_one(trainer, rank):
    _assert_holds(trainer["real"][rank], trainer["fake"][rank], rank)
    _assert_moves(trainer["real"][rank], trainer["fake"][rank])
    assert trainer["real"][rank]["virtual_stages"] == 2


def test_one_rerun_of_the_first_stage(trainer):
    progress = trainer["stderr"]
    assert "(again, round 1" in progress and "round 2" not in progress, progress[-2000:]
