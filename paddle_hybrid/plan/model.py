"""The transformer a plan prices: its shapes, from a script's arguments, a configuration file or a preset.

Only what the step's kernels and memory depend on: hidden, heads, kv heads, FFN, layers, vocabulary,
sequence length, the MLP's form (GELU: two matrices; SwiGLU: three), the norm, tied embeddings,
dropout, the attention kernel (flash, or Megatron's unfused QK^T / fused softmax / AV).
"""
from __future__ import annotations

import dataclasses
import json

__all__ = ["Transformer", "PRESETS", "from_config", "from_gpt_pp_args"]


@dataclasses.dataclass(frozen=True)
class Transformer:
    name: str
    hidden: int
    heads: int
    layers: int
    seq: int
    vocab: int
    ffn: int = 0                # 0: 4 x hidden
    kv_heads: int = 0           # 0: heads
    gated: bool = False         # SwiGLU (LLaMA): three FFN matrices
    rmsnorm: bool = False
    tied: bool = True
    dropout: bool = True
    attention: str = "flash"    # flash | unfused

    def __post_init__(self):
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention {self.attention!r}: flash or unfused")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.gated else 2) * h * self.ffn
        biases = 0 if self.rmsnorm else (h + 2 * kv + h + self.ffn + h)
        norms = (2 if self.rmsnorm else 4) * h
        return attn + mlp + biases + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        emb = self.embedding_params * (1 if self.tied else 2)
        return self.layers * self.layer_params + emb + (1 if self.rmsnorm else 2) * self.hidden

    def flops_per_token(self) -> float:
        """Model FLOPs of one token's forward and backward (no recompute), attention included: the
        numerator of MFU as Korthikanti et al. and PaLM count it (causal attention counted whole)."""
        h, s = self.hidden, self.seq
        matmul = 2 * self.layers * (self.layer_params - (0 if self.rmsnorm else 5 * h)) + 2 * self.vocab * h
        attention = 2 * 2 * self.layers * s * h
        return 3.0 * (matmul + attention)


PRESETS = {
    # GPT-3 shapes as Korthikanti et al. 2022 Table 5 ran them (seq 2048, vocab 51200)
    "gpt-22b": Transformer("gpt-22b", 6144, 64, 48, 2048, 51200, attention="unfused"),
    "gpt-175b": Transformer("gpt-175b", 12288, 96, 96, 2048, 51200, attention="unfused"),
    "gpt-530b": Transformer("gpt-530b", 20480, 128, 105, 2048, 51200, attention="unfused"),
    "gpt-1t": Transformer("gpt-1t", 25600, 160, 128, 2048, 51200, attention="unfused"),
    "llama3-8b": Transformer("llama3-8b", 4096, 32, 32, 8192, 128256, ffn=14336, kv_heads=8, gated=True,
                             rmsnorm=True, tied=False, dropout=False),
    "llama3-70b": Transformer("llama3-70b", 8192, 64, 80, 8192, 128256, ffn=28672, kv_heads=8, gated=True,
                              rmsnorm=True, tied=False, dropout=False),
    "llama2-7b": Transformer("llama2-7b", 4096, 32, 32, 4096, 32000, ffn=11008, gated=True, rmsnorm=True,
                             tied=False, dropout=False),
}


def from_config(path: str, seq: int | None = None) -> Transformer:
    """A LLaMA-style ``config.json`` (PaddleFormers / Hugging Face field names)."""
    with open(path) as f:
        c = json.load(f)
    try:
        return Transformer(name=c.get("model_type", "model"), hidden=c["hidden_size"], heads=c["num_attention_heads"],
                           layers=c["num_hidden_layers"], seq=seq or c.get("max_position_embeddings", 4096),
                           vocab=c["vocab_size"], ffn=c.get("intermediate_size", 0),
                           kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                           gated=c.get("hidden_act", "silu") in ("silu", "swiglu"), rmsnorm="rms_norm_eps" in c,
                           tied=bool(c.get("tie_word_embeddings", False)),
                           dropout=bool(c.get("hidden_dropout_prob", 0.0) or c.get("attention_dropout", 0.0)))
    except KeyError as missing:
        raise ValueError(f"{path}: no {missing} field: a LLaMA-style configuration is needed") from None


def from_gpt_pp_args(values: dict) -> Transformer:
    """examples/gpt_pp.py's model from its argument values (``{"hidden": 128, ...}`` as its parser names them): GELU
    MLP, LayerNorm, tied embeddings, its own attention (matmul + causal mask + softmax: unfused); without
    ``--vocab`` its character corpus's (a few dozen symbols, padded; 256 here)."""
    return Transformer(name="gpt_pp", hidden=int(values["hidden"]), heads=int(values["heads"]),
                       layers=int(values["layers"]), seq=int(values["seq_len"]), vocab=int(values.get("vocab") or 256),
                       ffn=int(values.get("ffn") or 0), tied=True, dropout=float(values.get("dropout") or 0.0) > 0,
                       attention="unfused")
