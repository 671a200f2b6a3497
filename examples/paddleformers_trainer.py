"""Train a tiny LLaMA with PaddleFormers' ``Trainer``, unchanged, in any fleet layout on CPU.

This is the script a PaddleFormers user writes: ``TrainingArguments`` from the command line, a
model ``from_pretrained``, a dataset, ``Trainer(...).train()``.  The only line for the plugin is
``import paddle_hybrid`` (or launch with ``python -m paddle_hybrid.launch``, which imports it in
every worker).  First write the tiny "pretrained" model once (one process, random init from a
seed), then train from it in any layout:

    python examples/paddleformers_trainer.py write-tiny-model runs/tiny-llama
    CPU="--device cpu --bf16 false --fp16 false --amp_master_grad false --split_param false"
    # one process
    python examples/paddleformers_trainer.py --model_name_or_path runs/tiny-llama \\
        --output_dir runs/one $CPU --max_steps 6 --gradient_accumulation_steps 2
    # TP2 (PP2: --pipeline_model_parallel_size 2; sharding: --sharding stage1 --sharding_parallel_size 2)
    python -m paddle_hybrid.launch --nproc_per_node 2 examples/paddleformers_trainer.py \\
        --model_name_or_path runs/tiny-llama --output_dir runs/tp2 $CPU --max_steps 6 \\
        --gradient_accumulation_steps 2 --tensor_model_parallel_size 2

Other model families of PaddleFormers: ``write-tiny-model PATH --family ernie4_5`` (``llama``,
``ernie4_5``, ``phi3``, ``gpt_oss``, ``gemma3_text``, ``deepseek_v3``, ``qwen3``,
``ernie4_5_moe``, ``qwen3_moe``, ``glm4_moe``, ``qwen2_moe``): the same tiny sizes (the last three
with 4 experts, top-2); the model is loaded through PaddleFormers' ``AutoModelForCausalLM`` (``...Pipe`` with a
pipeline), as a user's script would.  Qwen3-MoE, GLM4-MoE and Qwen2-MoE are PaddleFormers' own
``...ForCausalLMDeprecated`` models where paddlefleet is absent (``paddle_hybrid``'s stand-ins;
docs/paddleformers_trainer.md); expert parallelism over the tensor-parallel ranks:
``--tensor_model_parallel_size 2 --sequence_parallel true --use_expert_parallel true
--expert_model_parallel_size 2 --moe_token_dispatcher_type alltoall`` (GLM4-MoE also
``--use_unified_moe true``).  ``--untied``: an output layer of its own instead of the
embedding's (``tie_word_embeddings=False``).  ``--size small``: a model big enough that a step is
arithmetic more than Python (hidden 256, 4 layers, vocabulary 1024; the benchmarks' second size).

Every flag is a ``TrainingArguments`` flag except ``--model_name_or_path``, ``--seq_length``,
``--num_samples``, ``--moe_token_dispatcher_type``, ``--use_unified_moe`` (the model configuration's, which
PaddleFormers does not save), ``--init_from_config`` (:class:`ModelDataArguments`; builds the model from
``config.json`` with random weights, for a model whose checkpoint is not at hand, as
``python -m paddle_hybrid.dryrun`` runs LLaMA-3-8B) and ``--virtual_pipeline_model_parallel_size``
(the model configuration's virtual pipeline degree, which ``TrainingArguments`` has no flag for).  Saving (``--save_steps``) writes the Trainer's
default flex checkpoint; ``--resume_from_checkpoint runs/tp2/checkpoint-3`` resumes it, in this
layout or another.  Each rank writes the losses it logged and the wall-clock end of every step to
``<output_dir>/progress.rank<N>.json`` (``{"loss": {step: loss}, "step_end_time": {step: seconds}}``;
``--logging_steps 1`` gives a loss per step).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np


@dataclasses.dataclass
class ModelDataArguments:
    model_name_or_path: str = dataclasses.field(metadata={"help": "the model to train (write-tiny-model makes one)"})
    seq_length: int = dataclasses.field(default=16, metadata={"help": "tokens per sample"})
    num_samples: int = dataclasses.field(default=256, metadata={"help": "samples in the synthetic dataset"})
    init_from_config: bool = dataclasses.field(
        default=False, metadata={"help": "build the model from --model_name_or_path's config.json with random "
                                         "weights (seeded) instead of loading them: a model of any size without its "
                                         "checkpoint, as python -m paddle_hybrid.dryrun runs one"})
    moe_token_dispatcher_type: str = dataclasses.field(
        default="", metadata={"help": "the MoE layer's expert-parallel communication, \"alltoall\" or \"deepep\" "
                                      "(the model configuration's moe_token_dispatcher_type, which PaddleFormers does "
                                      "not save in config.json; empty: the configuration's own, \"deepep\")"})
    use_unified_moe: str = dataclasses.field(
        default="", metadata={"help": "true/false: the model configuration's use_unified_moe (GLM4-MoE's "
                                      "expert-parallel layer: PaddleFormers' ModularMoELayer); empty: the "
                                      "configuration's own"})
    virtual_pipeline_model_parallel_size: int = dataclasses.field(
        default=0, metadata={"help": "virtual pipeline stages a pipeline stage (the model configuration's "
                                     "virtual_pipeline_model_parallel_size, which TrainingArguments has no flag for; "
                                     "0: the configuration's own)"})


# --------------------------------------------------------------------------- the tiny model

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64)

# A model where a step is arithmetic more than per-operator Python (``write-tiny-model --size small``).
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=256)
SIZES = {"tiny": TINY, "small": SMALL}

# Families the example builds with eager attention: GPT-OSS's layouts (docs/paddleformers_trainer.md) were
# run with it, when PaddleFormers' sdpa path with sinks was flash attention only (it runs on CPU since
# paddleformers_fixes.sink_attention, equal to eager in one process).
EAGER_ONLY = ("gpt_oss",)

# family: (module of paddleformers.transformers, config class, causal LM class, its own tiny settings)
FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    "ernie4_5": ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 8}),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {}),
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
                {"head_dim": 8, "num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": None,
                 "layer_types": ["full_attention", "full_attention"], "_attn_implementation": "eager"}),
    "gemma3_text": ("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    # MoE from layer 1 (4 experts, top-2, a shared expert) with DeepSeek-V3's own routing (sigmoid scores, noaux_tc,
    # normalised and scaled weights; one group); its attention reads rope_parameters["factor"]
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                     "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                     "routed_scaling_factor": 2.5,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "factor": 1.0}}),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    # MoE from layer 1 (4 experts, top-2, a shared expert, the correction bias: PaddleFormers' defaults, which
    # its config.json keeps without the plugin); the MoE ops run on CPU through expert_parallel.moe_kernels
    # (docs/paddleformers_trainer.md, ERNIE-4.5-MoE on CPU)
    "ernie4_5_moe": ("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     {"head_dim": 8, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                      "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "num_nextn_predict_layers": 0}),
    # PaddleFormers' own models of these (paddlefleet builds ...ForCausalLM; GPU-only, not on the index): built on
    # a machine without paddlefleet through paddle_hybrid's stand-ins (docs/paddleformers_trainer.md, MoE families)
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated",
                  {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}),
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated",
                 {"head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                  "topk_group": 1, "norm_topk_prob": True}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLMDeprecated",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "norm_topk_prob": True}),
}
# Families whose modules import paddlefleet / paddlefleet_ops: the plugin's stand-ins let them import without.
PADDLEFLEET_FAMILIES = ("qwen3_moe", "glm4_moe", "qwen2_moe", "deepseek_v3")


def cpu_model_settings() -> dict:
    """LlamaConfig settings for CPU: PaddleFormers' fused kernels have no CPU kernel."""
    return dict(fuse_rms_norm=False, use_fused_linear_cross_entropy=False, apply_rope_fusion=False,
                fuse_swiglu=False, use_fused_head_and_loss_fn=False, _attn_implementation="sdpa")


def write_tiny_model(path: str, seed: int = 42, family: str = "llama", tie_embeddings: bool = True,
                     size: str = "tiny") -> None:
    """A random-init one-process model of ``family`` (sizes ``SIZES[size]``) saved with
    ``save_pretrained``: the "pretrained" model every layout starts from, so every layout starts
    from the same weights."""
    import importlib

    import paddle

    if family not in FAMILIES:
        raise SystemExit(f"--family {family!r}: one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise SystemExit(f"--size {size!r}: one of {', '.join(SIZES)}")
    module, config_name, model_name, own = FAMILIES[family]
    if family in PADDLEFLEET_FAMILIES:
        import paddle_hybrid  # noqa: F401  (the stand-ins of paddlefleet's imports)
    classes = importlib.import_module(f"paddleformers.transformers.{module}")
    paddle.set_device("cpu")
    paddle.seed(seed)
    settings = {**SIZES[size], "dtype": "float32", "pad_token_id": None, **cpu_model_settings(), **own}
    if not tie_embeddings:
        settings["tie_word_embeddings"] = False
    config = getattr(classes, config_name)(**settings)
    getattr(classes, model_name)(config).save_pretrained(path)
    print(f"wrote a tiny random-init {family} (seed {seed}) to {path}")


# --------------------------------------------------------------------------- data


class ArithmeticTokens:
    """Deterministic token sequences (arithmetic progressions modulo the vocabulary), as a
    map-style dataset of ``{"input_ids", "labels"}`` (next-token labels): the same samples in
    every layout, and learnable in a few steps."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        rng = np.random.default_rng(seed)
        start = rng.integers(0, vocab_size, size=(num_samples, 1))
        stride = rng.integers(1, 3, size=(num_samples, 1))
        self.tokens = ((start + stride * np.arange(seq_length + 1)) % vocab_size).astype("int64")

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


# --------------------------------------------------------------------------- training


def record_progress(output_dir: str):
    """A TrainerCallback writing every loss this rank logs, and when each step ended, to
    ``progress.rank<N>.json`` (rewritten at each event, so a run that stops keeps what it did)."""
    from paddleformers.trainer import TrainerCallback

    class ProgressRecorder(TrainerCallback):
        def __init__(self):
            self.progress = {"loss": {}, "step_end_time": {}}
            self.path = os.path.join(output_dir, f"progress.rank{int(os.environ.get('PADDLE_TRAINER_ID', '0'))}.json")

        def _write(self):
            with open(self.path, "w") as f:
                json.dump(self.progress, f)

        def on_step_end(self, args, state, control, **kwargs):
            self.progress["step_end_time"][int(state.global_step)] = time.time()
            self._write()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.progress["loss"][int(state.global_step)] = float(logs["loss"])
                self._write()

    return ProgressRecorder()


def load_model(model_args: ModelDataArguments, training_args):
    """The pretrained model (PaddleFormers' Auto classes) for this layout: the pipeline model with
    pipeline parallel, the causal LM otherwise; tensor parallel from the Trainer's arguments."""
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM, AutoModelForCausalLMPipe

    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    settings = cpu_model_settings()
    if getattr(config, "model_type", "") in EAGER_ONLY:
        settings.pop("_attn_implementation")
    config.update(settings)
    config.tensor_model_parallel_size = training_args.tensor_model_parallel_size
    config.tensor_parallel_rank = training_args.tensor_parallel_rank
    config.pipeline_model_parallel_size = training_args.pipeline_model_parallel_size
    config.sequence_parallel = training_args.sequence_parallel
    if model_args.virtual_pipeline_model_parallel_size:
        config.virtual_pipeline_model_parallel_size = model_args.virtual_pipeline_model_parallel_size
    config.max_sequence_length = model_args.seq_length  # sequence parallel splits sequences of this length
    config.seq_length = model_args.seq_length  # the MoE gates' per-sequence auxiliary loss reads this one
    if model_args.moe_token_dispatcher_type:
        config.moe_token_dispatcher_type = model_args.moe_token_dispatcher_type
    if model_args.use_unified_moe:
        config.use_unified_moe = model_args.use_unified_moe.lower() in ("1", "true", "yes")
    cls = AutoModelForCausalLMPipe if training_args.pipeline_model_parallel_size > 1 else AutoModelForCausalLM
    if model_args.init_from_config:
        import paddle

        paddle.seed(training_args.seed)
        config.dtype = "float32"
        return cls.from_config(config, dtype="float32")
    return cls.from_pretrained(model_args.model_name_or_path, config=config, dtype="float32")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["write-tiny-model"]:
        family = argv[argv.index("--family") + 1] if "--family" in argv else "llama"
        size = argv[argv.index("--size") + 1] if "--size" in argv else "tiny"
        write_tiny_model(argv[1], family=family, tie_embeddings="--untied" not in argv, size=size)
        return
    import paddle
    import paddle_hybrid  # noqa: F401  (gloo collectives and the CPU fixes; the launcher imports it too)
    from paddleformers.trainer import PdArgumentParser, Trainer, TrainingArguments

    model_args, training_args = PdArgumentParser((ModelDataArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    paddle.set_device(training_args.device)
    model = load_model(model_args, training_args)
    data = ArithmeticTokens(model_args.num_samples, model_args.seq_length, model.config.vocab_size,
                            training_args.seed)
    trainer = Trainer(model=model, args=training_args, train_dataset=data,
                      callbacks=[record_progress(training_args.output_dir)])
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    return trainer


if __name__ == "__main__":
    main()
