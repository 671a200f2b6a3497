"""PaddleFormers 1.2's generic pipeline model (``GeneralModelForCausalLMPipe``, ``nn/pp_model.py``):
what it gets wrong on every device, fixed or refused.

* **A segmentation that names a class the pipe never builds.**  The pipe wraps the model's decoder
  layer in a generated class named ``DecoderLayerPipe`` and cuts stages at the layers whose class
  name matches ``config.pp_seg_method`` (``"layer:<regex>|EmptyLayer"``).  ERNIE-4.5's default is
  ``"layer:Ernie4_5DecoderLayer|EmptyLayer"``: nothing matches, and building any pipeline stops
  with ``AssertionError: weight_idxs' length should be greater than 0`` (``pp_layers.py``).  Fixed:
  while the pipe is built, a name in the method that is the model's own decoder-layer class
  (``_decoder_layer_cls``, wrapped by the generated class) reads ``DecoderLayerPipe``; the config
  is given back unchanged afterwards.  The stages are the ones the name meant.
* **Sliding-window attention dropped.**  A config with ``sliding_window`` and ``"sliding_attention"``
  layers (Gemma3) is built anyway, with only a log line ("PP does not support sliding window
  attention"): every layer then attends over the whole sequence, a run that differs from one
  process with no error (seen: loss 4.4e-3 off).  Refused: a ``ValueError`` at the build naming
  the setting; a fix would change the model GPU users train.
* **Eager attention without a mask.**  The pipe hands each decoder layer the batch's attention
  mask only if the batch has one, and the model's own causal mask is not made: with
  ``_attn_implementation="eager"`` (GPT-OSS on CPU, whose other path is flash-attention only)
  attention is not causal, silently (seen: 2.6e-2 off).  Refused at the first such forward, naming
  the setting and what to pass.
"""
from __future__ import annotations

import functools
import re

__all__ = ["apply_to", "PipeModelError", "rewrite_seg_method"]

MODULE = "paddleformers.nn.pp_model"
PIPE_LAYER = "DecoderLayerPipe"


class PipeModelError(ValueError):
    """A pipeline model PaddleFormers would build wrong."""


def rewrite_seg_method(method, decoder_class: str):
    """``method`` with ``decoder_class`` read as the generated pipe layer's name."""
    if not isinstance(method, str) or not method.startswith("layer:"):
        return method
    names = method[len("layer:"):].split("|")
    if decoder_class not in names:
        return method
    return "layer:" + "|".join(PIPE_LAYER if n == decoder_class else n for n in names)


def _check_sliding_window(config) -> None:
    if getattr(config, "sliding_window", None) is not None and "sliding_attention" in (
            getattr(config, "layer_types", None) or []):
        raise PipeModelError(
            f"{type(config).__name__}: sliding_window={config.sliding_window} with 'sliding_attention' layers, and "
            f"PaddleFormers' pipeline model does not do sliding-window attention (it would attend over the whole "
            f"sequence in every layer, unlike the same model without a pipeline). Train it without pipeline "
            f"parallelism, or set sliding_window=None / use_sliding_window=False if that is the model you want. "
            f"(paddle_hybrid.paddleformers_fixes.pipe_models)")


def _make_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        _check_sliding_window(config)
        decoder = getattr(type(self), "_decoder_layer_cls", None)
        before = getattr(config, "pp_seg_method", None)
        if decoder is not None and getattr(type(self), "_decoder_layer_pipe_cls", None) is None:
            after = rewrite_seg_method(before, decoder.__name__)
            if after != before:
                config.pp_seg_method = after
        try:
            original(self, config, *args, **kwargs)
        finally:
            if before is not None:
                config.pp_seg_method = before

    return __init__


def _make_layer_pipe(original, parse_args):
    @functools.wraps(original)
    def make_decoder_layer_pipe(decoder_layer):
        cls = original(decoder_layer)
        forward = cls.forward

        @functools.wraps(forward)
        def checked_forward(self, args):
            if getattr(self.config, "_attn_implementation", None) == "eager":
                try:
                    mask = parse_args(args)[1]
                except Exception:  # noqa: BLE001  (a layout of inputs this check does not know: Paddle's own path)
                    mask = ...
                if mask is None:
                    raise PipeModelError(
                        f"{decoder_layer.__name__} in PaddleFormers' pipeline model with _attn_implementation='eager' "
                        f"and no attention_mask in the batch: the pipe makes no causal mask, so attention would see "
                        f"later tokens, unlike the same model without a pipeline. Give the batch an attention_mask, "
                        f"or use another attention implementation. (paddle_hybrid.paddleformers_fixes.pipe_models)")
            return forward(self, args)

        cls.forward = checked_forward
        return cls

    return make_decoder_layer_pipe


def apply_to(patcher, pp_model) -> None:
    """The fixes on PaddleFormers' ``nn/pp_model.py`` module ``pp_model``."""
    pipe = patcher.require(pp_model, "GeneralModelForCausalLMPipe", MODULE)
    init = patcher.require(pipe, "__init__", f"{MODULE}.GeneralModelForCausalLMPipe")
    patcher.check_params(init, ["self", "config", "kwargs"], "GeneralModelForCausalLMPipe.__init__")
    patcher.set(pipe, "__init__", _make_init(init))
    maker = patcher.require(pp_model, "make_decoder_layer_pipe", MODULE)
    parse_args = patcher.require(pp_model, "parse_args", MODULE)
    patcher.set(pp_model, "make_decoder_layer_pipe", _make_layer_pipe(maker, parse_args))
