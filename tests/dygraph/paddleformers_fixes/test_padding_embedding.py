"""paddleformers_fixes.padding_embedding: the padding token (``pad_token_id``) is looked up as zeros
and never trained under a pipeline and tensor parallelism, as LLaMA's model does in one process.

Before the fix, the tiny LLaMA with ``pad_token_id=0`` (its data holds token 0) trained other
numbers at pp2 and tp2 (the embedding's row 0 trained, every gradient clipped by another global
norm).  Skipped on Paddle < 3.3, where PaddleFormers 1.2.0 cannot run."""
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")


def _paddle_new_enough():
    import paddle

    version = tuple(int(x) for x in paddle.__version__.split(".")[:2])
    if version != (0, 0) and version < (3, 3):  # 0.0: a develop build, taken as new
        pytest.skip(f"PaddleFormers 1.2.0 needs Paddle >= 3.3, this is {paddle.__version__}")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _example():
    sys.path.insert(0, os.path.dirname(TRAINER))
    try:
        return importlib.import_module("paddleformers_trainer")
    finally:
        sys.path.remove(os.path.dirname(TRAINER))


def test_hook_gives_zeros_and_no_gradient_at_the_padding_id():
    """An embedding that has no padding_idx (as Paddle's VocabParallelEmbedding): the mask."""
    import paddle

    from paddle_hybrid.dygraph.paddleformers_fixes.padding_embedding import honour_padding

    class NoPadding(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.weight = self.create_parameter([6, 3])

        def forward(self, ids):
            return paddle.nn.functional.embedding(ids, self.weight)

    layer = NoPadding()
    honour_padding(layer, -2)  # id 4
    ids = paddle.to_tensor([[0, 4, 1, 4]])
    out = layer(ids)
    out.sum().backward()
    grad = layer.weight.grad.numpy()
    assert np.all(out.numpy()[0, [1, 3]] == 0) and np.all(out.numpy()[0, [0, 2]] != 0)
    assert np.all(grad[4] == 0) and np.all(grad[[0, 1]] == 1) and np.all(grad[[2, 3, 5]] == 0)


def test_the_padded_families_are_the_ones_whose_model_pads():
    """PADDED_PIPE_FAMILIES is what each family's one-process model does with pad_token_id, among the families
    whose pipe builds the generic embedding (one with its own class, as Gemma3, builds the one-process class)."""
    _paddle_new_enough()
    import paddle

    from paddle_hybrid.dygraph.paddleformers_fixes.padding_embedding import PADDED_PIPE_FAMILIES

    example = _example()
    paddle.set_device("cpu")
    padded, built = set(), set()
    for family, (module, config_cls, model_cls, own) in example.FAMILIES.items():
        try:
            classes = importlib.import_module(f"paddleformers.transformers.{module}")
            config = getattr(classes, config_cls)(**{**example.TINY, "dtype": "float32", "pad_token_id": 0,
                                                     **example.cpu_model_settings(), **own})
            model = getattr(classes, model_cls)
        except ImportError:  # a MoE family's GPU-only imports (paddleformers_fixes.families): not built on CPU
            continue
        if getattr(getattr(classes, model_cls + "Pipe", None), "_embed_cls", None) is not None:
            continue
        try:
            embedding = model(config).get_input_embeddings()
        except ImportError:  # paddlefleet's model (Qwen3), stood in for at import, needs paddlefleet to build
            continue
        built.add(family)
        if getattr(embedding, "padding_idx", None) == 0:
            padded.add(config.model_type)
    assert {"llama", "ernie4_5", "phi3"} <= built, built
    assert padded == set(PADDED_PIPE_FAMILIES)


def test_pipeline_and_tensor_parallel_equal_with_a_padding_token(tmp_path):
    _paddle_new_enough()
    # 8 samples, 2 steps of 2 x 2: the run sees every sample, and they hold the padding id 0 (the Trainer's seed 42)
    example = _example()
    assert (example.ArithmeticTokens(8, 16, example.TINY["vocab_size"], 42).tokens[:, :-1] == 0).any()
    model = str(tmp_path / "tiny-llama")
    subprocess.run([sys.executable, TRAINER, "write-tiny-model", model], check=True, capture_output=True,
                   env=_env(), timeout=300)
    config_path = os.path.join(model, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["pad_token_id"] = 0  # LlamaConfig's default: a LLaMA config without the field pads with token 0
    with open(config_path, "w") as f:
        json.dump(config, f)
    verdict_path = tmp_path / "verdict.json"
    proc = subprocess.run(
        [sys.executable, "-m", "paddle_hybrid.verify", "--layouts", "pp2,tp2", "--json", str(verdict_path),
         "--work-dir", str(tmp_path / "work"),
         TRAINER, "--model_name_or_path", model, "--output_dir", "unused", "--device", "cpu", "--bf16", "false",
         "--fp16", "false", "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none",
         "--max_steps", "2", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
         "--max_grad_norm", "1.0", "--save_strategy", "no", "--num_samples", "8", "--seq_length", "16"],
        env=_env(), capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    verdict = json.loads(verdict_path.read_text())
    assert set(verdict["layouts"]) == {"pp2", "tp2"}
    for name, layout in verdict["layouts"].items():
        assert layout["equal"] and not layout["findings"], (name, layout)


def test_listed_when_the_modules_are_imported_and_undone_at_uninstall():
    _paddle_new_enough()
    probe = ("import json\n"
             "import paddleformers.nn.pp_model as pp, paddleformers.nn.embedding as emb\n"
             "def now():\n"
             "    return emb.Embedding.__dict__['create'], pp.EmbeddingPipe.__dict__['__init__']\n"
             "stock = now()\n"
             "import paddle_hybrid\n"
             "names = [(p['owner'], p['name']) for p in paddle_hybrid.patches()\n"
             "         if p['component'].endswith('paddleformers_fixes')]\n"
             "patched = [a is not b for a, b in zip(now(), stock)]\n"
             "paddle_hybrid.uninstall()\n"
             "undone = [a is b for a, b in zip(now(), stock)]\n"
             "print('RESULT' + json.dumps([names, patched, undone]))\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names, patched, undone = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert patched == [True, True] and undone == [True, True], (patched, undone)
    assert {name for _, name in names} >= {"create", "__init__"}, names
