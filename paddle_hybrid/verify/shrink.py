"""``--shrink-from CONFIG``: a model configuration small enough to train on CPU that keeps, for the
layouts asked, what the real model has on each rank.

A layout's defects live in what one rank holds and exchanges: how many attention and key-value heads
a tensor-parallel rank has, how many layers a (virtual) pipeline stage has, how the vocabulary and
the sequence divide, how many experts an expert-parallel rank holds.  The widths (hidden size, head
dimension, FFN size) only make every tensor bigger.  So the shrunk model keeps the counts and the
divisibilities, and shrinks the widths and the layers per stage:

* **heads, kv heads, experts**: kept.  Each layout's tensor-parallel (expert-parallel) degree then
  gives a rank the real model's heads (experts) per rank, and the query-to-kv ratio (GQA's group)
  is the real one.  A count that does not divide over a layout's degree is refused: the real model
  cannot be split so either (PaddleFormers' attention asserts ``num_key_value_heads % tp == 0``).
* **routing** (MoE): kept as the real model routes, whatever the family calls it: the experts
  (:data:`EXPERT_FIELDS`), top-k (:data:`TOP_K_FIELDS`: ``num_experts_per_tok``, ``moe_k``), the shared
  experts (:data:`SHARED_FIELDS`: ``n_shared_experts``, ``moe_num_shared_experts``), the routing groups
  (``n_group``, ``topk_group``: DeepSeek-V3's and GLM4-MoE's group-limited routing).  Refused when the
  real model could not route so either: experts that do not split into the groups, more groups
  chosen than there are, a top-k beyond the experts (or the chosen groups') to choose from.
* **MoE layers**: which layers are MoE keeps the real model's shape in the shrunk layers (each family's
  rule: ``first_k_dense_replace`` and ``moe_layer_freq``; ``moe_layer_start_index`` /
  ``moe_layer_end_index`` / ``moe_layer_interval``; ``decoder_sparse_step`` and ``mlp_only_layers``):
  the dense layers first where the real model starts dense (one at least, leaving an MoE layer),
  the end index the last layer where it is the real last one, a spacing no wider than the shrunk
  layers, the dense-only layers that still exist; at least one MoE layer (:func:`moe_layers`).
* **head dimension** :data:`HEAD_DIM` (the real one when smaller), even: rotary embeddings turn
  pairs of dimensions.  The hidden size follows (heads x head dimension where the real model has
  that; else scaled by the same factor).
* **FFN sizes** (``intermediate_size``, the experts' and shared experts'): the real ratio to the
  hidden size, rounded up to a multiple of every tensor-parallel degree (each rank's slice whole);
  the experts' (``moe_intermediate_size``, ``shared_expert_intermediate_size``) at most
  :data:`EXPERT_FFN_CAP` (so rounded): an MoE layer keeps all its experts (DeepSeek-V3: 256), and an
  expert's width, like any width, is not what a rank's share of the layout is made of.
  Low-rank projections (MLA's ``q_lora_rank``, ``kv_lora_rank``) scale with the hidden size,
  MLA's head dimensions with the head dimension.
* **layers**: ``chunks x per chunk``, ``chunks`` the least common multiple of the layouts'
  ``pp x vp`` and ``per chunk`` the real model's layers per chunk at that many chunks, capped at
  :data:`LAYERS_PER_CHUNK_CAP` (two layers keep a boundary between layers inside a chunk, as the
  real model's chunks have when they hold two or more).  Refused when the real layers do not split
  evenly into the chunks (fewer layers than chunks, or a remainder).
* **vocabulary**: the smallest size of at least :data:`MIN_VOCAB` that, for every divisor ``n`` of
  ``128 x`` (the layouts' tensor-parallel degrees' least common multiple), is a multiple of ``n``
  exactly when the real vocabulary is: divisible by tp as the real one is, and not a multiple of a
  padding granularity (64, 128, 128 x tp) the real one is not.
* **sequence**: not in the configuration; the script's own flag (``--seq_length``,
  ``--max_seq_length``, ``--max_length``) must be a multiple of tp with sequence parallel and of
  sep, as on the real job; checked here, refused otherwise.

Anything else (``max_position_embeddings``, rope settings, norms, tying) is kept as is.  The verifier
then writes the shrunk model's weights once, from a seed, in one process (:func:`write_model`), and
every run, one process and each layout, loads them (see :func:`script_arguments`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

from .layouts import LayoutError

__all__ = ["Shrunk", "ShrinkError", "shrink", "from_file", "for_script", "prepare", "sequence_of", "script_arguments",
           "write_model", "moe_layers",
           "HEAD_DIM", "MIN_VOCAB", "LAYERS_PER_CHUNK_CAP", "VOCAB_GRANULARITY", "EXPERT_FFN_CAP"]

HEAD_DIM = 8
MIN_VOCAB = 64
LAYERS_PER_CHUNK_CAP = 2
VOCAB_GRANULARITY = 128  # padding granularities commonly used for vocabularies (x tp)
EXPERT_FFN_CAP = 32  # an expert's FFN width at most (rounded up to a whole slice per tensor-parallel rank)

HEAD_FIELDS = ("num_attention_heads",)
KV_FIELDS = ("num_key_value_heads",)
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_k", "moe_topk", "top_k")
SHARED_FIELDS = ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts")
FFN_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
EXPERT_FFN_FIELDS = ("moe_intermediate_size", "shared_expert_intermediate_size")
# the fields that say which layers are MoE (moe_layers): handled by _moe_placement, not as per-layer lists
MOE_LAYER_FIELDS = ("first_k_dense_replace", "moe_layer_freq", "moe_layer_start_index", "moe_layer_end_index",
                    "moe_layer_interval", "decoder_sparse_step", "mlp_only_layers")
LOW_RANK_FIELDS = ("q_lora_rank", "kv_lora_rank")
MLA_HEAD_DIM_FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SEQUENCE_FLAGS = ("--seq_length", "--max_seq_length", "--max_length")


class ShrinkError(LayoutError):
    """A configuration that cannot be shrunk for a layout; the message says why."""


@dataclasses.dataclass
class Field:
    name: str
    real: object
    shrunk: object
    why: str


@dataclasses.dataclass
class Shrunk:
    """The shrunk configuration and, per field changed or checked, its real value and the rule."""

    config: dict
    fields: list

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def describe(self) -> str:
        width = max(len(f.name) for f in self.fields)
        lines = [f"  {'field':<{width}}  {'real':>10}  {'shrunk':>8}  why"]
        lines += [f"  {f.name:<{width}}  {str(f.real):>10}  {str(f.shrunk):>8}  {f.why}" for f in self.fields]
        return "\n".join(lines)


def _degrees(layout) -> dict:
    """A layout's degrees, 1 for any the layout does not have (other engineers add vp, ep, sep)."""
    d = layout.degrees
    return {"tp": d.get("mp", 1), "pp": d.get("pp", 1), "vp": d.get("vp", 1), "ep": d.get("ep", 1),
            "sep": d.get("sep", 1), "sp": bool(getattr(layout, "sequence_parallel", False))}


def _distinct(values) -> list:
    return list(dict.fromkeys(values))


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _round_up(value: float, multiple: int) -> int:
    return max(multiple, int(math.ceil(value / multiple)) * multiple)


def _even(value: float) -> int:
    return max(2, int(round(value / 2)) * 2)


def _first(config: dict, names) -> str | None:
    return next((n for n in names if isinstance(config.get(n), int) and config[n] > 0), None)


def _heads(config: dict, layouts: list, fields: list) -> None:
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise ShrinkError("the configuration has no num_attention_heads: give a decoder model's config.json")
    kv = config.get("num_key_value_heads") or heads
    for layout in layouts:
        tp = _degrees(layout)["tp"]
        if heads % tp:
            raise ShrinkError(f"layout {layout.name}: {heads} attention heads over tp {tp} is not a whole number per "
                              f"rank; the real model cannot be split so either")
        if kv % tp:
            raise ShrinkError(f"layout {layout.name}: {kv} kv heads over tp {tp} is {kv / tp:g} per rank; "
                              f"PaddleFormers' attention splits kv heads evenly over the tensor-parallel ranks "
                              f"(num_key_value_heads % tp == 0), so the real model cannot be split so either: "
                              f"use a tp that divides {kv}")
    tps = _distinct(_degrees(l)["tp"] for l in layouts)
    per_rank = ", ".join(f"{heads // tp} per rank at tp{tp}" for tp in tps)
    fields.append(Field("num_attention_heads", heads, heads, f"kept: {per_rank}, as the real model"))
    if "num_key_value_heads" in config:
        per_rank = ", ".join(f"{kv // tp} per rank at tp{tp}" for tp in tps)
        fields.append(Field("num_key_value_heads", kv, kv, f"kept: {per_rank}; {heads // kv} query heads per kv "
                                                           f"head, as the real model"))


def _widths(config: dict, layouts: list, fields: list) -> None:
    """Head dimension, hidden size, FFN and low-rank sizes; returns nothing, appends to fields
    and sets the shrunk values in ``config``."""
    heads, hidden = config["num_attention_heads"], config.get("hidden_size")
    if not isinstance(hidden, int) or hidden < 1:
        raise ShrinkError("the configuration has no hidden_size: give a decoder model's config.json")
    real_head_dim = config.get("head_dim") or hidden // heads
    head_dim = min(_even(real_head_dim), _even(HEAD_DIM)) if real_head_dim >= 2 else real_head_dim
    factor = head_dim / real_head_dim
    if "head_dim" in config and config["head_dim"]:
        fields.append(Field("head_dim", real_head_dim, head_dim, f"small ({HEAD_DIM} at most) and even: rotary "
                                                               f"embeddings turn pairs of dimensions"))
    if hidden == heads * real_head_dim:
        new_hidden, why = heads * head_dim, (f"heads x head dimension ({heads} x {head_dim}), as the real model "
                                             f"({heads} x {real_head_dim})")
    else:
        new_hidden = _even(hidden * factor)
        why = f"scaled as the head dimension ({real_head_dim} -> {head_dim}), even"
    fields.append(Field("hidden_size", hidden, new_hidden, why))
    config["hidden_size"] = new_hidden
    if "head_dim" in config and config["head_dim"]:
        config["head_dim"] = head_dim
    tp_lcm = _lcm(_degrees(l)["tp"] for l in layouts)
    step = _lcm([tp_lcm, 2])
    for name in FFN_FIELDS:
        real = config.get(name)
        if not isinstance(real, int) or real < 1:
            continue
        for layout in layouts:
            tp = _degrees(layout)["tp"]
            if real % tp:
                raise ShrinkError(f"layout {layout.name}: {name} {real} over tp {tp} is not a whole slice per rank; "
                                  f"the real model cannot be split so either")
        config[name] = _round_up(real * new_hidden / hidden, step)
        why = (f"the real ratio to hidden_size ({real / hidden:.3g}), rounded up to a multiple of {step} (tp {tp_lcm}: "
               f"a whole slice per rank)")
        cap = _round_up(EXPERT_FFN_CAP, step)
        if name in EXPERT_FFN_FIELDS and config[name] > cap and _first(config, EXPERT_FIELDS):
            config[name], why = cap, (f"an expert's width, at most {EXPERT_FFN_CAP} (a multiple of {step}, tp "
                                      f"{tp_lcm}): every expert is kept; the real ratio to hidden_size "
                                      f"({real / hidden:.3g}) would give {config[name]}")
        fields.append(Field(name, real, config[name], why))
    for name in LOW_RANK_FIELDS:
        real = config.get(name)
        if isinstance(real, int) and real > 0:
            config[name] = _even(real * new_hidden / hidden)
            fields.append(Field(name, real, config[name], "scaled as hidden_size, even"))
    for name in MLA_HEAD_DIM_FIELDS:
        real = config.get(name)
        if isinstance(real, int) and real > 0:
            config[name] = min(real, _even(real * factor))
            fields.append(Field(name, real, config[name], "scaled as the head dimension, even (rotary pairs)"))


def _layers(config: dict, layouts: list, fields: list) -> None:
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ShrinkError("the configuration has no num_hidden_layers: give a decoder model's config.json")
    for layout in layouts:
        d = _degrees(layout)
        chunks = d["pp"] * d["vp"]
        if layers < chunks or layers % chunks:
            raise ShrinkError(f"layout {layout.name}: {layers} layers over pp{d['pp']} x vp{d['vp']} ({chunks} "
                              f"chunks) do not split evenly: the real model cannot be laid out so either, and a "
                              f"shrunk one could not keep its layers per chunk")
    chunks = _lcm(_degrees(l)["pp"] * _degrees(l)["vp"] for l in layouts)
    real_per_chunk = layers // chunks
    per_chunk = min(real_per_chunk, LAYERS_PER_CHUNK_CAP)
    config["num_hidden_layers"] = chunks * per_chunk
    capped = f", capped at {LAYERS_PER_CHUNK_CAP}" if per_chunk < real_per_chunk else ""
    splits = _distinct((_degrees(l)["pp"], _degrees(l)["vp"]) for l in layouts)
    stages = ", ".join(f"pp{pp} x vp{vp}: {config['num_hidden_layers'] // (pp * vp)} per chunk" for pp, vp in splits)
    fields.append(Field("num_hidden_layers", layers, config["num_hidden_layers"],
                        f"pp x vp chunks {chunks} x {per_chunk} per chunk (real {real_per_chunk}{capped}); {stages}"))
    _moe_placement(config, layers, fields)
    for name, value in list(config.items()):
        if isinstance(value, list) and len(value) == layers and name not in ("architectures",) + MOE_LAYER_FIELDS:
            config[name] = value[:config["num_hidden_layers"]]
            fields.append(Field(name, f"{layers} entries", f"{len(config[name])}", "one per layer: the first ones"))


def _int(config: dict, name: str, default=None):
    value = config.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def moe_layers(config: dict, layers: int | None = None) -> list:
    """The layers of ``config`` (its ``num_hidden_layers``, or ``layers``) that are MoE, by the rule of
    the fields it has (PaddleFormers 1.2's models): ``first_k_dense_replace`` / ``moe_layer_freq``
    (DeepSeek-V3, GLM4-MoE: ``i >= k and i % freq == 0``), ``moe_layer_start_index`` /
    ``moe_layer_end_index`` / ``moe_layer_interval`` (ERNIE-4.5-MoE: ``start <= i <= end`` (-1: the
    last) ``and (i + 1) % interval == 0``), ``decoder_sparse_step`` / ``mlp_only_layers`` (Qwen2/3-MoE:
    ``i not in mlp_only and (i + 1) % step == 0``); every layer for an MoE model with none of them;
    none for a model without experts."""
    layers = layers if layers is not None else _int(config, "num_hidden_layers", 0)
    if _first(config, EXPERT_FIELDS) is None:
        return []
    if "moe_layer_start_index" in config:
        start, end = _int(config, "moe_layer_start_index", 0), _int(config, "moe_layer_end_index", -1)
        end = layers - 1 if end == -1 else end
        interval = max(1, _int(config, "moe_layer_interval", 1))
        return [i for i in range(layers) if start <= i <= end and (i + 1) % interval == 0]
    if "decoder_sparse_step" in config or "mlp_only_layers" in config:
        step, dense = max(1, _int(config, "decoder_sparse_step", 1)), set(config.get("mlp_only_layers") or [])
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    first, freq = _int(config, "first_k_dense_replace", 0), max(1, _int(config, "moe_layer_freq", 1))
    return [i for i in range(layers) if i >= first and i % freq == 0]


def _spans(indices: list) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], None
    for i, v in enumerate(indices):
        if start is None:
            start = v
        if i + 1 == len(indices) or indices[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out) or "none"


def _moe_placement(config: dict, real_layers: int, fields: list) -> None:
    """Which of the shrunk layers are MoE, shaped as the real model's (see the module docstring)."""
    real = moe_layers(config, real_layers)
    if not real:
        return
    layers = config["num_hidden_layers"]
    last = max(1, layers - 1)  # the first layer an MoE layer can be when the real model starts dense

    def keep(name, value, why):
        fields.append(Field(name, config[name], value, why))
        config[name] = value

    for name, reserved in (("first_k_dense_replace", "dense layers first"), ("moe_layer_start_index", "the first "
                                                                                "MoE layer")):
        value = _int(config, name)
        if value is not None and value > 0:
            keep(name, min(value, last), f"{reserved} as the real model ({value}), leaving at least one MoE layer")
    end = _int(config, "moe_layer_end_index")
    if end is not None and end != -1:
        start = _int(config, "moe_layer_start_index", 0)
        keep("moe_layer_end_index", layers - 1 if end >= real_layers - 1 else max(min(end, layers - 1), start),
             "the last MoE layer: the last layer where the real one is")
    if isinstance(config.get("mlp_only_layers"), list) and config["mlp_only_layers"]:
        keep("mlp_only_layers", [i for i in config["mlp_only_layers"] if i < layers], "the dense-only layers that "
                                                                                      "still exist")
    for name in ("moe_layer_freq", "moe_layer_interval", "decoder_sparse_step"):
        value = _int(config, name)
        if value is not None and value > layers:
            keep(name, layers, f"a spacing no wider than the {layers} layers")
    for name in ("moe_layer_freq", "moe_layer_interval", "decoder_sparse_step"):
        if not moe_layers(config) and _int(config, name, 1) > 1:
            keep(name, 1, f"every layer after the dense ones: spaced {config[name]} the {layers} layers had no MoE "
                          f"layer")
    shrunk = moe_layers(config)
    if not shrunk:
        raise ShrinkError(f"no MoE layer is left of the real model's ({_spans(real)} of {real_layers}) in "
                          f"{layers} layers; shrink this configuration by hand")
    fields.append(Field("MoE layers", f"{_spans(real)} of {real_layers}", f"{_spans(shrunk)} of {layers}",
                        "the layers that are MoE, by the fields above" + (
                            "; dense ones first, as the real model" if real[0] > 0 else "")))


def _vocabulary(config: dict, layouts: list, fields: list) -> None:
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ShrinkError("the configuration has no vocab_size: give a decoder model's config.json")
    tp_lcm = _lcm(_degrees(l)["tp"] for l in layouts)
    modulus = VOCAB_GRANULARITY * tp_lcm
    kept = math.gcd(vocab, modulus)
    k = max(1, math.ceil(MIN_VOCAB / kept))
    while math.gcd(k, modulus // kept) != 1:  # gcd(kept * k, modulus) == kept exactly
        k += 1
    config["vocab_size"] = min(vocab, kept * k)
    split = ("divisible by tp " + str(tp_lcm) if vocab % tp_lcm == 0 else
             f"not divisible by tp {tp_lcm}, as the real one is not (the run shows what the real one does)")
    fields.append(Field("vocab_size", vocab, config["vocab_size"],
                        f"the smallest of at least {MIN_VOCAB} that is a multiple of each divisor of {modulus} "
                        f"({VOCAB_GRANULARITY} x tp) exactly when the real one is (largest such: {kept}); {split}"))


def _experts(config: dict, layouts: list, fields: list) -> None:
    name = _first(config, EXPERT_FIELDS)
    if name is None:
        return
    experts = config[name]
    for layout in layouts:
        ep = _degrees(layout)["ep"]
        if experts % ep:
            raise ShrinkError(f"layout {layout.name}: {experts} experts over ep {ep} is not a whole number per rank; "
                              f"the real model cannot be split so either")
    eps = _distinct(_degrees(l)["ep"] for l in layouts)
    per_rank = ", ".join(f"{experts // ep} per rank at ep{ep}" for ep in eps)
    fields.append(Field(name, experts, experts, f"kept: {per_rank}, as the real model"))
    _routing(config, experts, eps, fields)


def _routing(config: dict, experts: int, eps: list, fields: list) -> None:
    """Top-k, shared experts, routing groups: kept, each checked against the experts (see the module
    docstring)."""
    groups, chosen = _int(config, "n_group"), _int(config, "topk_group")
    if groups is not None and groups > 0:
        if experts % groups:
            raise ShrinkError(f"{experts} experts do not split into {groups} routing groups (n_group): the real model "
                              f"cannot route so either")
        per_group = experts // groups
        at_ep = ", ".join(f"at ep{ep} a rank holds {experts // ep} experts ({experts // ep / per_group:g} "
                          f"group{'' if experts // ep == per_group else 's'})" for ep in eps if ep > 1)
        fields.append(Field("n_group", groups, groups, f"kept: {groups} groups of {per_group} experts"
                                                       + (f"; {at_ep}" if at_ep else "")))
        if chosen is not None and chosen > 0:
            if chosen > groups:
                raise ShrinkError(f"topk_group {chosen} of {groups} routing groups: more groups chosen than there are")
            fields.append(Field("topk_group", chosen, chosen, f"kept: each token's experts from its top {chosen} "
                                                              f"groups of {groups}"))
    top_k_name = _first(config, TOP_K_FIELDS)
    if top_k_name is not None:
        top_k = config[top_k_name]
        offered = experts
        if groups and chosen and groups > 0 and chosen > 0:
            offered = chosen * (experts // groups)
            if top_k > offered:
                raise ShrinkError(f"top-{top_k} over {chosen} of {groups} groups of {experts // groups} experts: at "
                                  f"most {offered} experts to choose from")
        if top_k > offered:
            raise ShrinkError(f"top-{top_k} over {experts} experts: more than there are")
        fields.append(Field(top_k_name, top_k, top_k, f"kept: each token to {top_k} of the {experts} experts"))
    shared_name = _first(config, SHARED_FIELDS)
    if shared_name is not None:
        fields.append(Field(shared_name, config[shared_name], config[shared_name],
                            "kept: shared experts every token goes through, as the real model"))


def sequence_of(args: list) -> int | None:
    """The sequence length the script's arguments give (its ``--seq_length`` or alike), or None."""
    for i, a in enumerate(args):
        for flag in SEQUENCE_FLAGS:
            if a == flag and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return None


def _sequence(layouts: list, sequence: int | None, fields: list) -> None:
    needs = []
    for layout in layouts:
        d = _degrees(layout)
        multiple = _lcm([d["tp"] if d["sp"] else 1, d["sep"]])
        needs.append((layout, multiple))
        if sequence is not None and sequence % multiple:
            raise ShrinkError(f"layout {layout.name}: the sequence {sequence} does not split over "
                              f"{'sequence parallel tp ' + str(d['tp']) if d['sp'] else ''}"
                              f"{' and ' if d['sp'] and d['sep'] > 1 else ''}"
                              f"{'sep ' + str(d['sep']) if d['sep'] > 1 else ''}: give a multiple of {multiple}")
    multiple = _lcm(m for _, m in needs)
    if multiple > 1:
        fields.append(Field("sequence (script)", sequence if sequence is not None else "-",
                            sequence if sequence is not None else f"x{multiple}",
                            f"a multiple of {multiple} (tp with sequence parallel, sep)"
                            + ("" if sequence is not None else ": give the script's --seq_length")))


def shrink(config: dict, layouts: list, sequence: int | None = None) -> Shrunk:
    """The shrunk configuration of ``config`` (a ``config.json``'s dict) for ``layouts`` (the
    script's sequence length ``sequence`` checked when given); :class:`ShrinkError` when one
    cannot be made."""
    if not layouts:
        raise ShrinkError("--shrink-from needs at least one layout")
    out, fields = dict(config), []
    _heads(out, layouts, fields)
    _widths(out, layouts, fields)
    _layers(out, layouts, fields)
    _vocabulary(out, layouts, fields)
    _experts(out, layouts, fields)
    _sequence(layouts, sequence, fields)
    return Shrunk(config=out, fields=fields)


def from_file(path: str, layouts: list, sequence: int | None = None) -> Shrunk:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ShrinkError(f"--shrink-from {path}: cannot read a JSON configuration ({exc})") from exc
    if not isinstance(config, dict):
        raise ShrinkError(f"--shrink-from {path}: a config.json holds one JSON object")
    return shrink(config, layouts, sequence)


def _value(args: list, flag: str):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def script_arguments(args: list, model_dir: str) -> list:
    """The script's arguments with the shrunk model in place of its own: ``--model_name_or_path
    model_dir`` and ``--init_from_config false`` (the weights are in ``model_dir``, the same for
    every run; building from the configuration in each run would draw other weights per layout)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--model_name_or_path", "--init_from_config"):
            skip = True
            continue
        if a.startswith(("--model_name_or_path=", "--init_from_config=")):
            continue
        out.append(a)
    return out + ["--model_name_or_path", model_dir, "--init_from_config", "false"]


def seed_of(args: list) -> int:
    """The Trainer's ``--seed`` (its default, 42, when not given)."""
    return int(_value(args, "--seed") or 42)


def write_model(shrunk: Shrunk, directory: str, seed: int, timeout: float) -> tuple[bool, str]:
    """Write the shrunk model's weights (random, from ``seed``) and configuration into
    ``directory``, in a process of its own (it imports PaddleFormers); ``(ok, output)``."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(shrunk.config, f, indent=1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify.shrink", directory, str(seed)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"writing the shrunk model did not finish within {timeout:.0f} s"
    return proc.returncode == 0, proc.stdout + proc.stderr


def _write_weights(directory: str, seed: int) -> None:
    """In the writer's process: the causal LM of ``directory``'s configuration, its weights drawn
    from ``seed`` (PaddleFormers' initialisation), saved beside it."""
    import paddle
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM

    paddle.set_device("cpu")
    paddle.seed(seed)
    config = AutoConfig.from_pretrained(directory)
    config.dtype = "float32"
    AutoModelForCausalLM.from_config(config, dtype="float32").save_pretrained(directory)


def for_script(path: str, kind: str, layouts: list, args: list) -> Shrunk:
    """The shrunk configuration for a verifier run (the checks before any run): a Trainer script
    only, its sequence read from ``args``."""
    if kind != "trainer":
        raise ShrinkError(f"--shrink-from needs a Trainer script that loads --model_name_or_path (this one is a "
                          f"{kind} script); give such a script, or shrink its model yourself")
    try:
        sequence = sequence_of(args)
    except ValueError as exc:
        raise ShrinkError(f"the script's sequence length is not a number: {exc}") from exc
    return from_file(path, layouts, sequence)


def prepare(shrunk: Shrunk, path: str, args: list, directory: str, timeout: float) -> list | None:
    """Print the shrunk configuration, write its model into ``directory``; the script's arguments
    to train it, or None (the writer failed: its output printed)."""
    print(f"paddle_hybrid.verify: the model of {path}, shrunk (weights from seed {seed_of(args)} in {directory}):\n"
          f"{shrunk.describe()}", flush=True)
    ok, output = write_model(shrunk, directory, seed_of(args), timeout)
    if not ok:
        print(f"paddle_hybrid.verify: writing the shrunk model failed:\n{output[-3000:]}", file=sys.stderr)
        return None
    return script_arguments(args, directory)


if __name__ == "__main__":
    _write_weights(sys.argv[1], int(sys.argv[2]))
