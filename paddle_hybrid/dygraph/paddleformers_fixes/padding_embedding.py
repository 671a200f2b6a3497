"""PaddleFormers 1.2's padding token: looked up as zeros and never trained by the model in one
process, looked up and trained like any other token under a pipeline or tensor parallelism.

LLaMA's model (``LlamaModel``) builds its embedding with ``padding_idx=config.pad_token_id``:
Paddle's ``nn.Embedding`` then gives zeros for that id and no gradient to its row.  Two layouts
build the embedding without it, silently:

* **Pipeline** (``--pipeline_parallel_degree`` > 1): the generic pipe's ``EmbeddingPipe``
  (``nn/pp_model.py``) calls ``Embedding.create(config)`` with no ``padding_idx``.
* **Tensor parallelism** (``--tensor_model_parallel_size`` > 1, pipe or not): ``Embedding.create``
  (``nn/embedding.py``) builds Paddle's ``VocabParallelEmbedding``, which has no ``padding_idx``,
  and drops the argument.

A batch that holds the padding id then trains other numbers than one process: the padding row's
gradient enters the global norm, so with ``max_grad_norm`` (default 1.0) every gradient is clipped
by another factor, and the row moves.  The config default is ``pad_token_id=0``, so a LLaMA config
without the field (LLaMA-3-8B's) pads with token 0, a real token of its vocabulary (seen through
``python -m paddle_hybrid.verify --shrink-from``: every step-1 gradient 0.864 times one process's,
the embedding's row 0 trained; pp2, pp4, pp2vp2, pp4vp2 and tp2 alike).

Fixed, so every layout trains the model the one-process class defines: an embedding
``Embedding.create`` builds with a ``padding_idx`` it cannot pass on gives zeros at that id (its
output times a mask of the ids that are not it: no gradient reaches the row either), and the
pipe's embedding of a family whose one-process model pads (:data:`PADDED_PIPE_FAMILIES`) gets the
config's ``pad_token_id`` (Paddle's own ``padding_idx`` on a plain ``nn.Embedding``, the mask on a
vocabulary-parallel one).  This changes what the pipeline and tensor-parallel layouts train on
GPU too (the padding token is no longer learnt there either): the model one process trains.  If
the padding id is a real token you mean to train, set ``pad_token_id`` to the tokenizer's own
padding id, or to ``None``, in the model's config: then no layout pads.
"""
from __future__ import annotations

import functools

__all__ = ["apply_to_embedding", "apply_to_pipe", "honour_padding", "PADDED_PIPE_FAMILIES"]

EMBEDDING_MODULE = "paddleformers.nn.embedding"
PIPE_MODULE = "paddleformers.nn.pp_model"

# model_type of the families whose one-process model builds its embedding with
# padding_idx=config.pad_token_id through Embedding.create (PaddleFormers 1.2; checked against the
# models in tests/dygraph/paddleformers_fixes/test_padding_embedding.py).
PADDED_PIPE_FAMILIES = ("llama",)


def _zero_padding_hook(padding_idx):
    def zero_padding(layer, inputs, output):
        keep = (inputs[0] != padding_idx).astype(output.dtype).unsqueeze(-1)
        return output * keep

    return zero_padding


def honour_padding(layer, padding_idx: int) -> None:
    """``layer`` (an embedding) looks ``padding_idx`` up as zeros and gives its row no gradient."""
    import paddle

    size = getattr(layer, "origin_num_embeddings", None) or layer.weight.shape[0]
    if padding_idx < 0:
        padding_idx += size
    if isinstance(layer, paddle.nn.Embedding):
        layer.padding_idx = padding_idx
        return
    layer.register_forward_post_hook(_zero_padding_hook(padding_idx))
    layer._ph_padding_idx = padding_idx


def _make_create(create):
    """``Embedding.create``: an embedding built without the ``padding_idx`` it was given gets it."""

    def wrapped(cls, config, *args, **kwargs):
        import paddle

        padding_idx = kwargs.get("padding_idx")
        layer = create(cls, config, *args, **kwargs)
        if padding_idx is not None and not isinstance(layer, paddle.nn.Embedding):
            honour_padding(layer, padding_idx)
        return layer

    functools.update_wrapper(wrapped, create)
    return classmethod(wrapped)


def _make_pipe_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        embed_cls = args[0] if args else kwargs.get("embed_cls")
        padding_idx = getattr(config, "pad_token_id", None)
        if (embed_cls is None and padding_idx is not None
                and getattr(config, "model_type", None) in PADDED_PIPE_FAMILIES):
            honour_padding(self.embed_tokens, padding_idx)

    return __init__


def apply_to_embedding(patcher, embedding_module) -> None:
    """The fix on PaddleFormers' ``nn/embedding.py`` module."""
    from ...registry.patching import PatchSignatureError

    cls = patcher.require(embedding_module, "Embedding", EMBEDDING_MODULE)
    raw = cls.__dict__.get("create")
    if not isinstance(raw, classmethod):
        raise PatchSignatureError(
            f"{patcher.component}: {EMBEDDING_MODULE}.Embedding.create is {raw!r}, not the classmethod these fixes "
            f"were written for; unexpected PaddleFormers. Set {patcher.off_switch} to run without them.")
    patcher.check_params(raw.__func__, ["self", "config", "num_embeddings", "embedding_dim", "embedding_type",
                                        "weight_attr", "name", "kwargs"], f"{EMBEDDING_MODULE}.Embedding.create")
    patcher.set(cls, "create", _make_create(raw.__func__))


def apply_to_pipe(patcher, pp_model) -> None:
    """The fix on PaddleFormers' ``nn/pp_model.py`` module."""
    pipe = patcher.require(pp_model, "EmbeddingPipe", PIPE_MODULE)
    init = patcher.require(pipe, "__init__", f"{PIPE_MODULE}.EmbeddingPipe")
    patcher.check_params(init, ["self", "config", "embed_cls", "rotary_emb_cls"], "EmbeddingPipe.__init__")
    patcher.set(pipe, "__init__", _make_pipe_init(init))
