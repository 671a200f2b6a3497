"""``python -m paddle_hybrid.verify --shrink-from CONFIG``: LLaMA-3-8B's configuration (written here,
nothing downloaded) shrunk for tp8 x pp4 x vp2 keeps what each rank of the real model holds; a
layout the real model cannot take is refused before any run; and a shrunk LLaMA trains through
``examples/paddleformers_trainer.py`` at tp2 equal to one process.

Seen failing: with the vocabulary rule replaced by "the smallest multiple of tp of at least 64"
(64 at tp8), ``test_the_vocabulary_divides_as_the_real_one`` names 64 (not a multiple of 128
and 256 as 128256 is); with layers per chunk not capped, ``test_llama_8b_for_tp8_pp4_vp2`` names
32 layers (16 expected); with the kv-head check switched off, the tp16 refusal did not raise and
the command ran one process and 16 ranks for 45 s until PaddleFormers' own assertion
("num_heads: 8, tensor_model_parallel_size: 16") failed the run."""
import json
import os
import subprocess
import sys
import types

import pytest

from paddle_hybrid.verify import shrink
from paddle_hybrid.verify.layouts import Layout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def layout(name, **degrees):
    """A layout by its degrees (the command line's parser may not know vp yet: shrink reads
    ``degrees`` only)."""
    full = {"mp": 1, "pp": 1, "dp": 1, "sharding": 1, **degrees}
    return types.SimpleNamespace(name=name, degrees=full, sequence_parallel=False)


TP8_PP4_VP2 = layout("tp8pp4vp2", mp=8, pp=4, vp=2)


def test_llama_8b_for_tp8_pp4_vp2():
    got = shrink.shrink(LLAMA_3_8B, [TP8_PP4_VP2]).config
    tp, chunks = 8, 4 * 2
    # heads and kv heads per tensor-parallel rank: 4 and 1, as the real model
    assert got["num_attention_heads"] // tp == 32 // tp == 4 and got["num_attention_heads"] % tp == 0
    assert got["num_key_value_heads"] // tp == 8 // tp == 1 and got["num_key_value_heads"] % tp == 0
    # head dimension small and even; hidden = heads x head dimension as in the real model
    head_dim = got["hidden_size"] // got["num_attention_heads"]
    assert got["hidden_size"] == got["num_attention_heads"] * head_dim and head_dim == 8
    # FFN: the real ratio (3.5), a whole slice per rank
    assert got["intermediate_size"] % tp == 0 and got["intermediate_size"] / got["hidden_size"] == 14336 / 4096
    # 4 stages x 2 virtual chunks, 2 layers per chunk (the real 4 capped at 2)
    assert got["num_hidden_layers"] == chunks * 2 == 16
    # the rest as the real model
    for key in ("max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "hidden_act"):
        assert got[key] == LLAMA_3_8B[key], key


def test_the_vocabulary_divides_as_the_real_one():
    vocab = shrink.shrink(LLAMA_3_8B, [TP8_PP4_VP2]).config["vocab_size"]
    assert vocab < 1024 and vocab % 8 == 0  # small; divisible by tp as the real one
    modulus = shrink.VOCAB_GRANULARITY * 8
    for n in range(2, modulus + 1):
        if modulus % n == 0:  # a multiple of n exactly when 128256 is (256 yes, 512 no)
            assert (vocab % n == 0) == (128256 % n == 0), (vocab, n)


def test_the_printed_configuration_says_why():
    text = shrink.shrink(LLAMA_3_8B, [TP8_PP4_VP2]).describe()
    assert "4 per rank at tp8" in text and "1 per rank at tp8" in text
    assert "real 4, capped at 2" in text and "128256" in text and "14336" in text


@pytest.mark.parametrize("name, degrees, reason", [
    ("tp16", {"mp": 16}, "8 kv heads over tp 16 is 0.5 per rank"),
    ("pp8vp8", {"pp": 8, "vp": 8}, "32 layers over pp8 x vp8 (64 chunks) do not split evenly"),
    ("ep3", {"ep": 3}, "8 experts over ep 3 is not a whole number per rank"),
])
def test_a_layout_the_real_model_cannot_take_is_refused(name, degrees, reason):
    config = dict(LLAMA_3_8B, num_local_experts=8) if "ep" in degrees else LLAMA_3_8B
    with pytest.raises(shrink.ShrinkError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        shrink.shrink(config, [layout(name, **degrees)])


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(shrink.ShrinkError, match="the sequence 15 does not split over sequence parallel tp 2"):
        shrink.shrink(LLAMA_3_8B, [Layout("sp2")], sequence=15)


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


CPU_TRAINER = ["--output_dir", "unused", "--device", "cpu", "--bf16", "false", "--fp16", "false",
               "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none", "--save_strategy", "no",
               "--seq_length", "16", "--num_samples", "16"]


def test_the_command_refuses_before_any_run(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify", "--shrink-from", str(config), "--layouts",
                           "tp16", TRAINER, "--model_name_or_path", str(tmp_path), "--init_from_config", "true",
                           *CPU_TRAINER], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "8 kv heads over tp 16 is 0.5 per rank" in proc.stderr
    assert "ran in" not in proc.stdout  # nothing ran


def test_a_shrunk_llama_trains_at_tp2_as_one_process(tmp_path):
    import paddle

    version = tuple(int(x) for x in paddle.__version__.split(".")[:2])
    if version != (0, 0) and version < (3, 3):  # 0.0: a develop build, taken as new
        pytest.skip(f"PaddleFormers 1.2.0 needs Paddle >= 3.3, this is {paddle.__version__}")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))
    work, verdict_path = tmp_path / "work", tmp_path / "verdict.json"
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify", "--shrink-from", str(config), "--layouts",
                           "tp2", "--work-dir", str(work), "--json", str(verdict_path), TRAINER,
                           "--model_name_or_path", str(tmp_path), "--init_from_config", "true", "--max_steps", "2",
                           "--per_device_train_batch_size", "2", *CPU_TRAINER],
                          env=_env(), capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    layout_verdict = json.loads(verdict_path.read_text())["layouts"]["tp2"]
    assert layout_verdict["equal"] and not layout_verdict["findings"], layout_verdict
    trained = json.loads((work / "shrunk-model" / "config.json").read_text())  # what every run loaded
    assert (trained["hidden_size"], trained["num_hidden_layers"], trained["vocab_size"]) == (256, 2, 256)
    assert "--model_name_or_path " + str(work / "shrunk-model") in (work / "tp2" / "log.txt").read_text()
