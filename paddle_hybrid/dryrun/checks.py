"""Configuration errors found before any rank runs: each names the field, the values and the fix.

From the command line of the script (its degree flags, :mod:`paddle_hybrid.common.script_kind`) and,
for a PaddleFormers Trainer script, the model's ``config.json`` (``--model_name_or_path``):

- the world (``--nnodes x --nproc_per_node``) is not the product of the degrees;
- expert parallelism does not divide the data-parallel replicas or the experts (a script's
  ``experts`` flag);
- tensor parallelism does not divide the attention heads, the key/value heads (fewer kv heads than
  tensor-parallel ranks: each rank needs one whole), the vocabulary, or (sequence parallel) the
  sequence;
- pipeline stages (x virtual stages) do not divide the layers, or leave a stage without a layer;
- fewer microbatches (gradient accumulation steps) than pipeline stages, which 1F1B needs; with a
  virtual pipeline, fewer than twice the stages or fewer than 3 stages, which Paddle's interleaved
  schedule refuses (an assertion in the middle of the first step otherwise);
- fewer than 2 optimizer steps where the tool knows the flag (a Trainer's ``--max_steps``, a script's
  ``steps`` in its ``PADDLE_HYBRID_LAYOUT_FLAGS``): the second step is the one measured.  A script can
  still stop earlier than its flag says (its data, an exit): the dry run checks the steps each rank's
  probe saw after its run as well (:func:`too_few_steps` words that refusal).

A Trainer's virtual pipeline degree is its model's ``virtual_pipeline_model_parallel_size``
(``config.json``: PaddleFormers 1.2's TrainingArguments has no flag for it), or the script's own
``--virtual_pipeline_model_parallel_size`` argument where it has one and it is given.
"""
from __future__ import annotations

import json
import os
import re

from ..common.script_kind import TRAINER_VP_FLAG, flag_value, script_value

__all__ = ["ConfigError", "degrees_of", "check", "microbatches_of", "with_microbatches", "with_one_chunk",
           "MEASURED_STEP", "steps_flag", "given_steps", "too_few_steps"]

TRAINER_MICROBATCHES = "--gradient_accumulation_steps"
TRAINER_STEPS = "--max_steps"
MEASURED_STEP = 2  # the optimizer step the probe measures: the first makes the optimizer state
WHY_STEP_2 = ("the dry run measures activations and the steady-state peak in the second optimizer step (the first "
              "makes the optimizer state)")


class ConfigError:
    """One configuration error: the field, and the message (the values, the fix)."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message

    def as_json(self) -> dict:
        return {"field": self.field, "message": self.message}

    def __repr__(self):
        return f"{self.field}: {self.message}"


TRAINER_VP = "virtual_pipeline_model_parallel_size"  # a model configuration's field (no TrainingArguments flag)
TRAINER_FLAGS = {"mp": "--tensor_model_parallel_size", "pp": "--pipeline_model_parallel_size",
                 "sharding": "--sharding_parallel_size", "sep": "--sep_parallel_size"}


def degrees_of(kind: str, args: list, flags: dict | None, world_size: int, defaults: dict | None = None) -> dict:
    """{"mp", "pp", "dp", "sharding", "sep", "vp", "ep"} as the script will take them (data parallel: what the
    world leaves, for a Trainer and a script that declares no data-parallel flag; expert parallel: over the
    data-parallel replicas, all of them unless given)."""
    degrees = {"mp": 1, "pp": 1, "dp": 1, "sharding": 1, "sep": 1, "vp": 1, "ep": 1}
    if kind == "flags":
        flags = flags or {}
        for key in degrees:
            value = script_value(args, flags, key, defaults)
            degrees[key] = int(value) if value is not None else 1
        if "vp" not in flags:
            degrees["vp"] = int(flag_value(args, "--vp", 1))
        if "dp" not in flags:
            degrees["dp"] = _remainder(degrees, world_size)
        if "ep" in flags and script_value(args, flags, "ep", defaults) is None:
            degrees["ep"] = degrees["dp"] * degrees["sharding"]
        return degrees
    if kind == "trainer":
        for key, flag in TRAINER_FLAGS.items():
            degrees[key] = int(flag_value(args, flag, 1))
        given = flag_value(args, TRAINER_VP_FLAG)  # a script's own argument for it wins (see common.script_kind)
        degrees["vp"] = int(given if given not in (None, "0") else (trainer_config(args) or {}).get(TRAINER_VP, 1) or 1)
        degrees["dp"] = _remainder(degrees, world_size)
        return degrees
    return degrees


def _remainder(degrees: dict, world_size: int) -> int:
    """Data parallelism as what the world leaves the other degrees (0: they do not divide it)."""
    others = degrees["mp"] * degrees["pp"] * degrees["sharding"] * degrees["sep"]
    return world_size // others if others and world_size % others == 0 else 0


def _microbatch_flag(kind: str, flags: dict | None):
    if kind == "trainer":
        return TRAINER_MICROBATCHES, 1
    if kind == "flags" and flags and "accumulate" in flags:
        return flags["accumulate"], None
    return None, None


def microbatches_of(kind: str, args: list, flags: dict | None) -> int | None:
    """Microbatches a step of the script's own arguments (None: the script does not say how it takes them)."""
    flag, default = _microbatch_flag(kind, flags)
    if flag is None:
        return None
    value = flag_value(args, flag, default)
    return int(value) if value is not None else None


def with_microbatches(kind: str, args: list, flags: dict | None, n: int) -> list:
    """The script's arguments with ``n`` microbatches a step (``--measure-microbatches``)."""
    flag, _ = _microbatch_flag(kind, flags)
    if flag is None:
        raise SystemExit("--measure-microbatches: the script does not say how it takes its microbatches (a Trainer's "
                         "--gradient_accumulation_steps, or \"accumulate\" in its PADDLE_HYBRID_LAYOUT_FLAGS)")
    return [*args, flag, str(n)]  # the last value given wins


def trainer_config(args: list) -> dict | None:
    """The model's ``config.json`` a Trainer script is given (``--model_name_or_path``), or None."""
    path = flag_value(args, "--model_name_or_path")
    config_file = os.path.join(path, "config.json") if path else None
    if not config_file or not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return json.load(f)


def with_one_chunk(kind: str, args: list, flags: dict | None, work: str) -> list:
    """The script's arguments with a virtual pipeline of 1 and the same layers per stage (``--measure-microbatches``
    with a virtual pipeline: Paddle's interleaved schedule needs at least twice the stages in microbatches).  A
    Trainer's model directory is mirrored into ``work`` (links to its files) with its configuration's degree 1."""
    if kind == "flags":
        return [*args, (flags or {}).get("vp", "--vp"), "1"]
    if flag_value(args, TRAINER_VP_FLAG) is not None:
        return [*args, TRAINER_VP_FLAG, "1"]
    path = flag_value(args, "--model_name_or_path")
    mirror = os.path.join(work, "model-one-chunk")
    os.makedirs(mirror, exist_ok=True)
    for name in os.listdir(path):
        target = os.path.join(mirror, name)
        if name != "config.json" and not os.path.lexists(target):
            os.symlink(os.path.abspath(os.path.join(path, name)), target)
    config = dict(trainer_config(args), **{TRAINER_VP: 1})
    with open(os.path.join(mirror, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return [*args, "--model_name_or_path", mirror]  # the last value given wins


TRAINER_LAYERS = "num_hidden_layers"  # a model configuration's field


def layers_of(kind: str, args: list, flags: dict | None, defaults: dict | None) -> int:
    """The model's layers as the script takes them (``--compose-layers``); SystemExit naming how to give them."""
    if kind == "flags" and flags and "layers" in flags:
        value = script_value(args, flags, "layers", defaults)
    elif kind == "trainer":
        value = (trainer_config(args) or {}).get(TRAINER_LAYERS)
    else:
        value = None
    if value is None:
        raise SystemExit("--compose-layers needs the script's layers: \"layers\" in its PADDLE_HYBRID_LAYOUT_FLAGS "
                         "with the value given or a literal default, or a Trainer's --model_name_or_path with "
                         f"{TRAINER_LAYERS} in its config.json")
    return int(value)


def with_layers(kind: str, args: list, flags: dict | None, work: str, n: int) -> list:
    """The script's arguments with a model of ``n`` layers (``--compose-layers``): the flag of ``layers`` in its
    ``PADDLE_HYBRID_LAYOUT_FLAGS``; a Trainer's model directory mirrored into ``work`` (links to its files) with
    its configuration's layers ``n``."""
    if kind == "flags":
        return [*args, flags["layers"], str(n)]
    path = flag_value(args, "--model_name_or_path")
    mirror = os.path.join(work, f"model-{n}-layers")
    os.makedirs(mirror, exist_ok=True)
    for name in os.listdir(path):
        target = os.path.join(mirror, name)
        if name != "config.json" and not os.path.lexists(target):
            os.symlink(os.path.abspath(os.path.join(path, name)), target)
    config = dict(trainer_config(args), **{TRAINER_LAYERS: n})
    with open(os.path.join(mirror, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return [*args, "--model_name_or_path", mirror]  # the last value given wins


def _divides(errors, field, n, by, what, fix):
    if by > 1 and n % by:
        errors.append(ConfigError(field, f"{field} = {n} does not divide by {what} {by}: {fix}"))


def check(kind: str, args: list, flags: dict | None, world_size: int, nnodes: int, nproc: int,
          defaults: dict | None = None) -> tuple:
    """(degrees, [ConfigError]) for the script's command line in a world of ``nnodes x nproc``; ``defaults``:
    the script's parser defaults of its declared flags (:func:`~paddle_hybrid.common.script_kind.argument_defaults`)."""
    errors = []
    degrees = degrees_of(kind, args, flags, world_size, defaults)
    product = degrees["mp"] * degrees["pp"] * degrees["dp"] * degrees["sharding"] * degrees["sep"]
    if degrees["dp"] == 0:  # data parallelism is what the world leaves: it must divide
        others = degrees["mp"] * degrees["pp"] * degrees["sharding"] * degrees["sep"]
        errors.append(ConfigError(
            "world", f"--nnodes {nnodes} x --nproc_per_node {nproc} = {world_size} ranks, but the degrees (tp "
            f"{degrees['mp']} x pp {degrees['pp']} x sharding {degrees['sharding']} x sep {degrees['sep']}) make "
            f"{others}, which does not divide it (data parallelism takes what is left): a world that is a multiple "
            f"of {others}, or other degrees"))
    elif kind in ("flags", "trainer") and product != world_size:
        errors.append(ConfigError(
            "world", f"--nnodes {nnodes} x --nproc_per_node {nproc} = {world_size} ranks, but the degrees "
            f"(tp {degrees['mp']} x pp {degrees['pp']} x dp {degrees['dp']} x sharding {degrees['sharding']} x sep "
            f"{degrees['sep']}) make {product}: change the world or the degrees so they agree"))
    if kind == "trainer":
        errors += _trainer_model(args, degrees)
    if kind == "flags":
        errors += _flags_model(args, flags, defaults, degrees)
    errors += _interleaved(degrees, microbatches_of(kind, args, flags), kind)
    errors += _steps(kind, args, flags, defaults)
    return degrees, errors


def steps_flag(kind: str, flags: dict | None):
    """The script's flag of its optimizer steps: a Trainer's ``--max_steps``, a ``flags`` script's ``steps``
    (gpt_pp.py's ``--steps``); None: the tool does not know it (a plain fleet script)."""
    if kind == "trainer":
        return TRAINER_STEPS
    if kind == "flags":
        return (flags or {}).get("steps")
    return None


def given_steps(kind: str, args: list, flags: dict | None, defaults: dict | None = None):
    """The optimizer steps the script's arguments ask for (given, else its parser's literal default), or None:
    no flag known, not an integer, or a Trainer's ``--max_steps`` not positive (its epochs and data decide)."""
    flag = steps_flag(kind, flags)
    if flag is None:
        return None
    value = flag_value(args, flag) if kind == "trainer" else script_value(args, flags, "steps", defaults)
    try:
        steps = int(value)
    except (TypeError, ValueError):
        return None
    return None if kind == "trainer" and steps <= 0 else steps


def _steps(kind: str, args: list, flags: dict | None, defaults: dict | None) -> list:
    steps = given_steps(kind, args, flags, defaults)
    if steps is None or steps >= MEASURED_STEP:
        return []
    flag = steps_flag(kind, flags)
    return [ConfigError(flag, f"{flag} = {steps}: {WHY_STEP_2}; give {flag} {MEASURED_STEP} or more")]


def _resumed_at(kind: str, args: list):
    """A Trainer resuming a checkpoint: (its step from the ``checkpoint-N`` name, or None; the path), else None."""
    path = flag_value(args, "--resume_from_checkpoint") if kind == "trainer" else None
    if path is None or path.strip().lower() in ("", "false", "no", "0", "none"):
        return None
    match = re.search(r"checkpoint-(\d+)/*$", path)
    return (int(match.group(1)) if match else None), path


def too_few_steps(kind: str, args: list, flags: dict | None, defaults: dict | None, seen: int) -> tuple:
    """(field, message) of the refusal of a rank's run whose probe saw ``seen`` optimizer steps, fewer than
    the measured one's number: the flag and the value to give where the tool knows the flag, and what the
    arguments already asked for when that was enough (something else ended the script)."""
    ended = f"the script ended after {seen} optimizer step{'' if seen == 1 else 's'}"
    flag = steps_flag(kind, flags)
    if flag is None:
        return "optimizer steps", f"{ended}; {WHY_STEP_2}: run at least {MEASURED_STEP} optimizer steps"
    fix = f"give {flag} {MEASURED_STEP} or more"
    steps = given_steps(kind, args, flags, defaults)
    resumed = _resumed_at(kind, args)
    if steps is not None and steps >= MEASURED_STEP and resumed is not None:
        at, path = resumed
        fix = (f"give {flag} {at + MEASURED_STEP if at is not None else 'its step + ' + str(MEASURED_STEP)} or more "
               f"(it was given {flag} {steps} and resumes from {path}, whose "
               f"{f'step {at}' if at is not None else 'step'} the Trainer counts)")
    elif steps is not None and steps >= MEASURED_STEP:
        fix += f" (it was given {flag} {steps}: something else ended it earlier, such as its data or an exit)"
    elif kind == "trainer" and steps is None:
        fix += " (without it, --num_train_epochs and the data decide)"
    return flag, f"{ended}; {WHY_STEP_2}: {fix}"


def _flags_model(args: list, flags: dict, defaults: dict | None, degrees: dict) -> list:
    """The sizes a script declares in its ``PADDLE_HYBRID_LAYOUT_FLAGS`` (``heads``, ``layers``, ``seq_len``,
    ``experts``), as given or by its parser's default, against the degrees."""
    def size(key):
        value = script_value(args, flags, key, defaults)
        return int(value) if value is not None else None

    errors = []
    tp, pp, vp, ep, sep = degrees["mp"], degrees["pp"], degrees["vp"], degrees["ep"], degrees["sep"]
    heads, layers, sequence, experts = size("heads"), size("layers"), size("seq_len"), size("experts")
    if heads is not None:
        _divides(errors, flags["heads"], heads, tp, "tensor parallelism", f"a tensor-parallel degree dividing {heads}")
    if layers is not None and pp * vp > 1:
        if layers < pp * vp:
            errors.append(ConfigError(flags["layers"], f"{flags['layers']} = {layers} for {pp} stages x {vp} virtual "
                                      f"stages: a chunk would have no layer; fewer stages"))
        else:
            _divides(errors, flags["layers"], layers, pp * vp, f"{pp} stages x {vp} virtual stages =",
                     "a layer count or degrees that divide evenly (the largest stage decides memory and time)")
    if sequence is not None:
        _divides(errors, flags["seq_len"], sequence, sep, "segment parallelism", "a sequence length that is a multiple")
        if "sp" in flags and flags["sp"] in args:
            _divides(errors, flags["seq_len"], sequence, tp, "tensor parallelism (sequence parallel)",
                     "a sequence length that is a multiple of it")
    if ep > 1 and (degrees["dp"] * degrees["sharding"]) % ep:
        errors.append(ConfigError("ep", f"expert parallelism {ep} over {degrees['dp'] * degrees['sharding']} "
                                        "data-parallel replicas: it must divide them; another degree"))
    if experts is not None:
        _divides(errors, flags["experts"], experts, ep, "expert parallelism", f"an expert-parallel degree dividing "
                 f"{experts}")
    return errors


def _interleaved(degrees: dict, microbatches: int | None, kind: str) -> list:
    """Paddle's interleaved schedule (a virtual pipeline) asserts at least 3 stages and twice the stages in
    microbatches."""
    pp, vp = degrees["pp"], degrees["vp"]
    if vp <= 1:
        return []
    field = TRAINER_VP if kind == "trainer" else "virtual pipeline"
    if pp < 3:
        return [ConfigError(field, f"{vp} virtual stages over {pp} pipeline stages: Paddle's interleaved schedule needs "
                                   "3 stages or more; more stages, or no virtual pipeline")]
    if microbatches is not None and microbatches < 2 * pp:
        flag = TRAINER_MICROBATCHES if kind == "trainer" else "the microbatches flag"
        return [ConfigError("microbatches", f"{microbatches} microbatches a step with a virtual pipeline over {pp} "
                                            f"stages: Paddle's interleaved schedule needs at least 2 x {pp} = {2 * pp}; "
                                            f"give {flag} {2 * pp} or more")]
    return []


def _trainer_model(args: list, degrees: dict) -> list:
    errors = []
    config = trainer_config(args)
    if config is None:
        return errors
    tp, pp, vp = degrees["mp"], degrees["pp"], degrees["vp"]
    heads = int(config.get("num_attention_heads", 0) or 0)
    kv_heads = int(config.get("num_key_value_heads", heads) or heads)
    vocab = int(config.get("vocab_size", 0) or 0)
    layers = int(config.get("num_hidden_layers", 0) or 0)
    _divides(errors, "num_attention_heads", heads, tp, "tensor parallelism",
             f"a tensor-parallel degree dividing {heads}")
    if tp > 1 and kv_heads and kv_heads % tp and tp % kv_heads:
        errors.append(ConfigError("num_key_value_heads", f"num_key_value_heads = {kv_heads} and tensor parallelism {tp}: "
                                  "neither divides the other, so the key/value heads cannot be split or replicated "
                                  f"evenly: a tensor-parallel degree dividing {kv_heads} or a multiple of it"))
    _divides(errors, "vocab_size", vocab, tp, "tensor parallelism",
             f"pad the vocabulary to a multiple of {tp} or another tensor-parallel degree")
    chunks = pp * vp
    if chunks > 1 and layers:
        if layers < chunks:
            errors.append(ConfigError("num_hidden_layers", f"num_hidden_layers = {layers} for {pp} stages x {vp} virtual "
                                      f"stages = {chunks} chunks: a chunk would have no layer; fewer stages"))
        elif layers % chunks:
            errors.append(ConfigError("num_hidden_layers", f"num_hidden_layers = {layers} does not divide by {pp} stages "
                                      f"x {vp} virtual stages = {chunks}: uneven stages (the largest decides memory "
                                      "and time); a degree dividing it"))
    sequence = flag_value(args, "--max_seq_len", flag_value(args, "--seq_length"))
    if sequence is not None and str(flag_value(args, "--sequence_parallel", "false")).lower() in ("1", "true"):
        _divides(errors, "sequence length", int(sequence), tp, "tensor parallelism (sequence parallel)",
                 "a sequence length that is a multiple of it")
    steps = int(flag_value(args, "--gradient_accumulation_steps", 1))
    if pp > 1 and steps < pp:
        errors.append(ConfigError("gradient_accumulation_steps", f"gradient_accumulation_steps = {steps} microbatches for "
                                  f"{pp} pipeline stages: 1F1B keeps every stage busy only with at least {pp}; give "
                                  f"--gradient_accumulation_steps {pp} or more"))
    return errors
