"""PaddleFormers 1.2 model families that cannot train right, refused at the start with what to do.

Each was tried in one process and in TP2 / PP2 through ``python -m paddle_hybrid.verify``
(``examples/paddleformers_trainer.py``, tiny configs); on every device these defects are the same,
and a fix would change the model a GPU user trains, so the plugin refuses instead:

* **GPT-OSS under tensor parallelism**: each rank builds the attention ``sinks`` for its own heads
  (``num_heads / tp``) without marking them distributed; the experts' weights and biases differ
  between the tensor-parallel ranks after step 1 (per-rank gradients), and the q/k/v biases end
  far from one process's.  The run finishes with a plausible loss 1.1e-2 off one process after
  step 1, no error.
* **Gemma3 under tensor parallelism**: with the default ``tensor_parallel_output`` the vocabulary-
  parallel loss stops on the plain, unsplit embedding tied to it ("the vocab_size should be
  splited"); with ``tensor_parallel_output=False`` it trains, and every norm weight differs between
  the tensor-parallel ranks after step 1 (each rank's own gradient).
* **Qwen2 / Qwen3 (and their MoE), GLM4-MoE, DeepSeek-V3** import GPU-only packages (paddlefleet,
  paddlefleet_ops) that are not on the package index: stood in for by :mod:`.paddlefleet_standins`
  (PaddleFormers' own model classes then build); their expert-parallel layers by :mod:`.moe_dispatcher`.

(GPT-OSS and Gemma3 under a pipeline are refused by :mod:`.pipe_models`.)
"""
from __future__ import annotations

import functools

__all__ = ["FamilyRefused", "REFUSE_TENSOR_PARALLEL", "tensor_parallel_refusal"]


class FamilyRefused(ValueError):
    """A model family PaddleFormers would train wrong in this layout."""


# module: (class whose __init__ gets config, family, why)
REFUSE_TENSOR_PARALLEL = {
    "paddleformers.transformers.gpt_oss.modeling": (
        "GptOssDecoderLayer", "GPT-OSS",
        "its attention sinks are sized per rank (heads / tp) but not marked distributed, and the experts train "
        "from per-rank gradients: the run ends with a plausible loss, 1e-2 off one process after one step"),
    "paddleformers.transformers.gemma3_text.modeling": (
        "Gemma3DecoderLayer", "Gemma3",
        "its plain embedding is tied to a vocabulary-parallel head (the parallel loss stops on it), and with "
        "tensor_parallel_output=False every norm weight trains from each rank's own gradient"),
}


def tensor_parallel_refusal(module_name: str, config) -> FamilyRefused | None:
    cls_name, family, why = REFUSE_TENSOR_PARALLEL[module_name]
    degree = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if degree <= 1:
        return None
    return FamilyRefused(f"{family} with tensor parallelism ({degree}) in PaddleFormers 1.2: {why}. Train {family} "
                         f"without tensor parallelism (data parallel and sharding are not affected). "
                         f"(paddle_hybrid.paddleformers_fixes.families; python -m paddle_hybrid.verify shows it)")


def _make_init(original, module_name):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        refused = tensor_parallel_refusal(module_name, config)
        if refused is not None:
            raise refused
        original(self, config, *args, **kwargs)

    return __init__


def refuse_in(patcher, module) -> None:
    """The tensor-parallel refusal on ``module`` (one of :data:`REFUSE_TENSOR_PARALLEL`)."""
    cls_name = REFUSE_TENSOR_PARALLEL[module.__name__][0]
    cls = patcher.require(module, cls_name, module.__name__)
    original = patcher.require(cls, "__init__", f"{module.__name__}.{cls_name}")
    patcher.set(cls, "__init__", _make_init(original, module.__name__))
