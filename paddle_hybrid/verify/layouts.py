"""Layouts as the verifier's command line names them, and how each becomes a run of the script.

A layout is degrees joined: ``tp2`` (tensor parallel), ``pp2`` (pipeline), ``pp4vp2`` (4 stages of
2 virtual stages each: the interleaved schedule), ``dp2`` (data parallel), ``sharding2`` (sharding
stage 1; ``sharding2s2`` / ``sharding2s3``: fleet's group-sharded stages 2 and 3), ``sp2`` (tensor
parallel 2 with sequence parallel), ``sep2`` (segment parallel: each rank holds a part of every
sequence), ``ep2`` (expert parallel), ``tp2pp2``, ``dp2tp2`` ...

Its processes are the product of tp, pp, dp, sharding and sep.  Virtual stages add none (they are
chunks of each stage); expert parallel adds none either: as in Paddle's topology, the experts are
spread over the data-parallel replicas (dp x sharding), so ``ep`` must divide them, and a layout
that names no data parallel gets as many replicas as ``ep`` (``ep2`` is 2 processes, each a
data-parallel replica holding half the experts; ``dp4ep2`` is 4, two expert groups of 2).

How a script takes a layout depends on what the script is (:func:`kind_of`):

* ``trainer`` (PaddleFormers' ``TrainingArguments`` in the script): the Trainer's own flags
  (``--tensor_model_parallel_size``, ``--pipeline_model_parallel_size``, ``--sharding stage1``
  (``stage2``, ``stage3``) ``--sharding_parallel_size``, ``--sep_parallel_size``,
  ``--sequence_parallel true``); data parallel is what is left of the processes.
  ``--per_device_train_batch_size`` is divided by the data-parallel replicas, so every layout
  trains the same global batch as one process.  PaddleFormers 1.2 has no virtual-pipeline flag:
  ``vp`` goes through the script's own ``--virtual_pipeline_model_parallel_size`` where it declares
  one (``examples/paddleformers_trainer.py``), and is refused where it does not.  Expert parallel: on
  CPU PaddleFormers' Trainer takes one expert-parallel layout, the experts spread over the
  tensor-parallel ranks with sequence parallelism (docs/paddleformers_trainer.md), so ``epN`` (and
  ``tpNepN``, ``spNepN``) is that: ``--tensor_model_parallel_size N --sequence_parallel true
  --use_expert_parallel true --expert_model_parallel_size N``, N processes, no data parallelism
  (:func:`for_kind`).  Refused, naming the flag: EP beside data parallelism (its
  ``TrainingArguments`` refuses it), beside sharding (PaddleFormers' ``MoEHybridParallelOptimizer``
  asks for sharding V2, ``--split_param``, which asks for ``--amp_master_grad``, which asks for
  bf16/fp16), beside a pipeline or segment parallel (not tried), an EP degree other than TP, and the
  EP flags given on the command line (the layout states them).
* ``flags``: the script declares how it takes degrees, in a module-level dict
  ``PADDLE_HYBRID_LAYOUT_FLAGS`` (read from its source, not run; ``examples/gpt_pp.py`` and
  ``examples/moe_ep.py`` have one).  Its keys (:data:`FLAG_KEYS`): the degrees ``mp``, ``pp``,
  ``vp``, ``dp``, ``sharding``, ``sep``, ``ep``, ``sharding_stage``, the switch ``sp``; the batch,
  ``batch`` (per data-parallel replica: divided by the replicas) or ``global_batch`` (over all of
  them: given unchanged, it must split evenly); what the degrees must divide, ``layers``, ``heads``,
  ``seq_len``, ``experts``, and ``accumulate`` (microbatches a step); ``steps``, its optimizer steps
  (passed on as given here; ``python -m paddle_hybrid.dryrun`` checks it).  Each degree key present is
  stated in every run (1 in the one-process run); a layout that needs a key the script lacks is
  refused naming it.
* ``fleet``: anything else: the plugin puts the degrees (tp, pp, dp, sharding, sep) into the
  strategy ``fleet.init`` gets, and draws every weight again by its name (``seeded_init``), so
  every layout starts from one model.  Such a script must feed each data-parallel replica its
  share of the batch itself.  Virtual stages, group-sharded stages and expert parallel are the
  script's own calls (``PipelineLayer``, ``group_sharded_parallel``, its MoE layer): refused.

A layout the script cannot take is refused before any run (:func:`layout_args` raises
:class:`LayoutError`), naming the missing flag or the degree that does not divide what.
"""
from __future__ import annotations

import re

from ..common.script_kind import TRAINER_VP_FLAG, argument_defaults, kind_of
from ..common.script_kind import script_flags as _declared_flags

__all__ = ["Layout", "parse_layouts", "kind_of", "script_flags", "ScriptFlags", "layout_args", "LayoutError",
           "DEGREES", "FLAG_KEYS", "for_kind", "TRAINER_EP_FLAGS"]

TRAINER_DEFAULT_BATCH = "8"  # TrainingArguments' per_device_train_batch_size when not given
DEGREES = ("mp", "pp", "vp", "dp", "sharding", "sep", "ep")
# every key a PADDLE_HYBRID_LAYOUT_FLAGS may have (see the module's docstring)
FLAG_KEYS = DEGREES + ("sharding_stage", "sp", "batch", "global_batch", "accumulate", "layers", "heads", "seq_len",
                       "experts", "steps")
_PART = re.compile(r"(tp|mp|pp|vp|dp|sharding|sep|sp|ep)(\d+)")
_STAGE = re.compile(r"s(\d+)")  # right after sharding's degree: its stage
KINDS = ("trainer", "flags", "fleet")
EXAMPLES = "tp2, pp2, pp4vp2, dp2, sharding2, sharding2s3, sp2, sep2, ep2, tp2pp2"


class LayoutError(ValueError):
    """A layout the verifier cannot make; the message says what to write instead."""


class Layout:
    """One layout: ``name`` as given, its ``degrees`` (every key of :data:`DEGREES`, 1 when not
    named), ``sharding_stage`` (1, 2 or 3), ``sequence_parallel`` (sp) and ``implied_dp`` (the data
    parallelism expert parallel brought, no ``dp`` being named)."""

    def __init__(self, name: str):
        self.name = name
        self.degrees = {key: 1 for key in DEGREES}
        self.sharding_stage = 1
        self.sequence_parallel = False
        self.implied_dp = False
        self._parse(name)
        self._check()

    def _parse(self, name: str) -> None:
        pos = 0
        while pos < len(name):
            match = _PART.match(name, pos)
            if match is None:
                break
            kind, n = match.group(1), int(match.group(2))
            if n < 1:
                raise LayoutError(f"layout {name!r}: degree {n} of {kind} must be at least 1")
            if kind == "sp":
                kind, self.sequence_parallel = "mp", True
            self.degrees["mp" if kind == "tp" else kind] = n
            pos = match.end()
            stage = _STAGE.match(name, pos) if kind == "sharding" else None
            if stage is not None:
                self.sharding_stage = int(stage.group(1))
                pos = stage.end()
        if pos != len(name) or not name:
            raise LayoutError(f"layout {name!r}: write degrees joined, e.g. {EXAMPLES}")

    def _check(self) -> None:
        d, name = self.degrees, self.name
        if self.sequence_parallel and d["mp"] < 2:
            raise LayoutError(f"layout {name!r}: sequence parallel needs tensor parallel of 2 or more (sp2)")
        if d["vp"] > 1 and d["pp"] < 2:
            raise LayoutError(f"layout {name!r}: virtual stages are chunks of pipeline stages; name 2 or more "
                              f"stages with them (pp2vp{d['vp']}, pp4vp{d['vp']})")
        if self.sharding_stage not in (1, 2, 3):
            raise LayoutError(f"layout {name!r}: sharding stage {self.sharding_stage} does not exist; write "
                              "sharding2 (stage 1), sharding2s2 or sharding2s3")
        if self.sharding_stage > 1 and d["sharding"] < 2:
            raise LayoutError(f"layout {name!r}: group-sharded stage {self.sharding_stage} needs a sharding degree "
                              f"of 2 or more (sharding2s{self.sharding_stage})")
        if d["ep"] > 1:
            if d["dp"] * d["sharding"] == 1:
                d["dp"], self.implied_dp = d["ep"], True
            elif (d["dp"] * d["sharding"]) % d["ep"]:
                raise LayoutError(f"layout {name!r}: expert parallel {d['ep']} spreads the experts over the "
                                  f"data-parallel replicas (dp {d['dp']} x sharding {d['sharding']} = "
                                  f"{d['dp'] * d['sharding']}), which it must divide")

    @property
    def nprocs(self) -> int:
        d = self.degrees
        return d["mp"] * d["pp"] * d["dp"] * d["sharding"] * d["sep"]

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (data parallel times sharding): each takes a share of the batch."""
        return self.degrees["dp"] * self.degrees["sharding"]

    def __repr__(self):
        return f"Layout({self.name!r})"


ONE_PROCESS = Layout("tp1")  # every degree 1

# The Trainer's expert-parallel flags: the verifier states them per layout (none in one process).
TRAINER_EP_FLAGS = ("--use_expert_parallel", "--expert_model_parallel_size")


def for_kind(kind: str, layout: Layout | None) -> Layout | None:
    """``layout`` as a script of ``kind`` runs it: for a Trainer script an expert-parallel layout is
    the one PaddleFormers' Trainer takes on CPU, EP over the tensor-parallel ranks with sequence
    parallelism (``ep2`` and ``tp2ep2``: tensor parallel 2, sequence parallel, expert parallel 2, 2
    processes, no data parallelism), refused (:class:`LayoutError`, naming the flag) where the Trainer
    cannot take it; every other layout, and any layout of another kind, as it is.  Idempotent."""
    if kind != "trainer" or layout is None or layout.degrees["ep"] < 2:
        return layout
    import copy

    d, name, ep = dict(layout.degrees), layout.name, layout.degrees["ep"]
    if layout.implied_dp:  # epN alone: Paddle's topology reuses the data-parallel ranks, the Trainer the TP ones
        d["dp"] = 1
    over_tp = (f"on CPU PaddleFormers' Trainer takes expert parallel only over the tensor-parallel ranks with "
               f"sequence parallel (write ep{ep}: --tensor_model_parallel_size {ep} --sequence_parallel true "
               f"--expert_model_parallel_size {ep})")
    refusals = [
        (d["dp"] > 1, f"data parallel {d['dp']} beside --expert_model_parallel_size {ep}: PaddleFormers' "
                      "TrainingArguments refuses expert parallel with data parallel (NotImplementedError)"),
        (d["sharding"] > 1, f"--sharding (sharding {d['sharding']}) beside --expert_model_parallel_size {ep}: "
                            "PaddleFormers' MoEHybridParallelOptimizer asks for sharding V2 (--split_param true), "
                            "which asks for --amp_master_grad, which asks for bf16/fp16 (refused on CPU)"),
        (d["pp"] > 1, f"--pipeline_model_parallel_size {d['pp']} beside --expert_model_parallel_size {ep}: not tried "
                      "(the MoE families' pipeline models under expert parallel)"),
        (d["sep"] > 1, f"--sep_parallel_size {d['sep']} beside --expert_model_parallel_size {ep}: segment parallel "
                       "is refused for the Trainer (paddleformers_fixes.segment_parallel)"),
        (d["mp"] not in (1, ep), f"--tensor_model_parallel_size {d['mp']} with --expert_model_parallel_size {ep}: "
                                 "an expert-parallel group other than the tensor-parallel group was not tried"),
    ]
    for refused, why in refusals:
        if refused:
            raise LayoutError(f"layout {name}: a Trainer script cannot take {why}; {over_tp}")
    adapted = copy.copy(layout)
    d["mp"] = ep
    adapted.degrees, adapted.implied_dp, adapted.sequence_parallel = d, False, True
    return adapted


def parse_layouts(text: str) -> list:
    layouts = [Layout(part.strip()) for part in text.split(",") if part.strip()]
    if not layouts:
        raise LayoutError("--layouts: give at least one layout, e.g. --layouts tp2,pp2,dp2")
    return layouts


class ScriptFlags(dict):
    """A script's ``PADDLE_HYBRID_LAYOUT_FLAGS`` with ``defaults``: the default its argument parser
    gives each of those flags (``add_argument(flag, ..., default=<literal>)`` in its source), so a
    layout can be checked against the script's model before any run."""

    def __init__(self, declared: dict, defaults: dict):
        super().__init__(declared)
        self.defaults = defaults


def script_flags(source: str) -> ScriptFlags | None:
    """The script's ``PADDLE_HYBRID_LAYOUT_FLAGS`` (a literal), or None; unknown keys refused."""
    declared = _declared_flags(source)
    if declared is None:
        return None
    unknown = sorted(set(declared) - set(FLAG_KEYS))
    if unknown:
        raise LayoutError(f"PADDLE_HYBRID_LAYOUT_FLAGS: unknown keys {unknown}; the keys are {', '.join(FLAG_KEYS)}")
    return ScriptFlags(declared, argument_defaults(source, declared.values()))


def _value(args: list, flag: str, default=None):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def _without(args: list, flags) -> list:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def _share(batch, replicas: int, flag: str, layout: Layout) -> str:
    batch = int(batch)
    if batch % replicas:
        raise LayoutError(f"layout {layout.name}: {flag} {batch} does not split over {replicas} data-parallel "
                          f"replicas; give a multiple of {replicas}, so each replica takes an equal share of the "
                          f"batch one process trains")
    return str(batch // replicas)


def layout_args(kind: str, args: list, layout: Layout | None, flags: dict | None = None) -> list:
    """The script's arguments for ``layout`` (None: one process); :class:`LayoutError` if the
    script cannot take it."""
    if kind == "trainer":
        return _trainer_args(list(args), layout, flags)
    if kind == "flags":
        return _flags_args(list(args), layout, flags)
    if layout is not None:
        _fleet_can_take(layout)
    return list(args)


def _trainer_args(args: list, layout: Layout | None, flags: dict | None = None) -> list:
    """``flags``: the degree flags the script declares beyond TrainingArguments'
    (:func:`~paddle_hybrid.common.script_kind.trainer_flags`)."""
    args = _without(args, ["--logging_steps"]) + ["--logging_steps", "1"]
    given = [flag for flag in TRAINER_EP_FLAGS if _value(args, flag) is not None]
    if given:
        raise LayoutError(f"{given[0]} on the script's command line: give expert parallel through the layout "
                          "(ep2, tp2ep2), which states it in each run (none in one process)")
    if layout is None:
        return args
    layout = for_kind("trainer", layout)
    d = layout.degrees
    if d["vp"] > 1 and "vp" not in (flags or {}):
        raise LayoutError(f"layout {layout.name}: a Trainer script takes vp{d['vp']} only through an argument "
                          f"{TRAINER_VP_FLAG} that sets the model configuration's virtual_pipeline_model_parallel_size "
                          "(PaddleFormers' TrainingArguments has no virtual-pipeline flag; "
                          "examples/paddleformers_trainer.py has one)")
    given = _value(args, "--per_device_train_batch_size", TRAINER_DEFAULT_BATCH)
    args = _without(args, ["--tensor_model_parallel_size", "--pipeline_model_parallel_size", "--sharding",
                           "--sharding_parallel_size", "--sequence_parallel", "--per_device_train_batch_size",
                           "--sep_parallel_size", TRAINER_VP_FLAG])
    batch = _share(given, layout.replicas, "--per_device_train_batch_size", layout)
    extra = ["--per_device_train_batch_size", batch]
    if d["mp"] > 1:
        extra += ["--tensor_model_parallel_size", str(d["mp"])]
    if d["pp"] > 1:
        extra += ["--pipeline_model_parallel_size", str(d["pp"])]
    if "vp" in (flags or {}):  # stated in every layout: the configuration's own may be another
        extra += [flags["vp"], str(d["vp"])]
    if d["sharding"] > 1:
        extra += ["--sharding", f"stage{layout.sharding_stage}", "--sharding_parallel_size", str(d["sharding"])]
    if d["sep"] > 1:
        extra += ["--sep_parallel_size", str(d["sep"])]
    if layout.sequence_parallel:
        extra += ["--sequence_parallel", "true"]
    if d["ep"] > 1:
        extra += ["--use_expert_parallel", "true", "--expert_model_parallel_size", str(d["ep"])]
    return args + extra


def _fleet_can_take(layout: Layout) -> None:
    d = layout.degrees
    own = [(d["vp"] > 1, f"vp{d['vp']}", "virtual stages (its PipelineLayer's num_virtual_pipeline_stages)", "vp"),
           (layout.sharding_stage > 1, f"sharding stage {layout.sharding_stage}",
            "a group-sharded stage (its group_sharded_parallel call)", "sharding_stage"),
           (d["ep"] > 1, f"ep{d['ep']}", "expert parallel (its MoE layer's group)", "ep")]
    for needed, what, whose, key in own:
        if needed:
            raise LayoutError(f"layout {layout.name}: a plain fleet script takes only the degrees of fleet's strategy "
                              f"(tp, pp, dp, sharding, sep); {what} is {whose}: declare how the script takes it in "
                              f"PADDLE_HYBRID_LAYOUT_FLAGS (key {key!r}, docs/verify.md)")


def _flags_args(args: list, layout: Layout | None, flags: dict) -> list:
    target = layout or ONE_PROCESS
    stated = {key: target.degrees[key] for key in DEGREES}
    stated["sharding_stage"] = target.sharding_stage
    out = _without(args, [flags[k] for k in (*DEGREES, "sharding_stage", "batch") if k in flags])
    out = [a for a in out if a != flags.get("sp")]
    for key in (*DEGREES, "sharding_stage"):  # every degree stated: the script's defaults may be others
        if key in flags:
            out += [flags[key], str(stated[key])]
        elif stated[key] > 1 and not _taken_by_ep(key, target, flags):
            raise LayoutError(f"layout {target.name}: the script's PADDLE_HYBRID_LAYOUT_FLAGS has no {key!r}: it "
                              f"cannot take {_words(key, stated[key])}")
    if target.sequence_parallel:
        if "sp" not in flags:
            raise LayoutError(f"layout {target.name}: the script's PADDLE_HYBRID_LAYOUT_FLAGS has no 'sp': it cannot "
                              "take sequence parallel")
        out.append(flags["sp"])
    out += _batch_args(args, layout, flags)
    if layout is not None:
        _check_divides(args, layout, flags)
    return out


def _taken_by_ep(key: str, layout: Layout, flags: dict) -> bool:
    """A script that runs expert parallel over all its data-parallel replicas (``examples/moe_ep.py``)
    has no data-parallel flag of its own: its ``ep`` flag says both, when they are equal."""
    return key == "dp" and layout.implied_dp and "ep" in flags


def _words(key: str, n: int) -> str:
    return {"mp": f"tensor parallel {n}", "pp": f"{n} pipeline stages", "vp": f"{n} virtual stages a stage",
            "dp": f"data parallel {n}", "sharding": f"sharding {n}", "sep": f"segment parallel {n}",
            "ep": f"expert parallel {n}", "sharding_stage": f"sharding stage {n}"}[key]


def _batch_args(args: list, layout: Layout | None, flags: dict) -> list:
    replicas = layout.replicas if layout is not None else 1
    if "global_batch" in flags:  # the script divides it itself: it must split evenly
        flag = flags["global_batch"]
        given = _value(args, flag, getattr(flags, "defaults", {}).get(flag))
        if layout is not None and given is not None:
            _share(given, replicas, flag, layout)
        return []
    if "batch" not in flags:
        return []
    given = _value(args, flags["batch"], getattr(flags, "defaults", {}).get(flags["batch"]))
    if given is not None:
        return [flags["batch"], _share(given, replicas, flags["batch"], layout) if layout else str(given)]
    if replicas > 1:
        raise LayoutError(f"layout {layout.name}: give {flags['batch']} on the command line, so the verifier "
                          f"can split it over the {replicas} data-parallel replicas")
    return []


def _size(args: list, flags: dict, key: str):
    """The value of the script's flag for ``key`` (given, else its argument parser's default), or None."""
    if key not in flags:
        return None
    value = _value(args, flags[key], getattr(flags, "defaults", {}).get(flags[key]))
    return int(value) if value is not None else None


def _check_divides(args: list, layout: Layout, flags: dict) -> None:
    """The degrees against what the script's model is made of (the flags it declares for that)."""
    d, name = layout.degrees, layout.name

    def refuse(key, value, by, what):
        raise LayoutError(f"layout {name}: {flags[key]} {value} does not divide by {what} ({by}); give "
                          f"{flags[key]} a multiple of {by}, or another layout")

    chunks = d["pp"] * d["vp"]
    layers = _size(args, flags, "layers")
    if layers is not None and chunks > 1 and layers % chunks:
        refuse("layers", layers, chunks, f"pp {d['pp']} x vp {d['vp']} = {chunks} chunks: layers per virtual stage"
               if d["vp"] > 1 else f"{d['pp']} pipeline stages: layers per stage")
    heads = _size(args, flags, "heads")
    if heads is not None and heads % d["mp"]:
        refuse("heads", heads, d["mp"], "tensor parallel: heads per rank")
    sequence = _size(args, flags, "seq_len")
    if sequence is not None and sequence % d["sep"]:
        refuse("seq_len", sequence, d["sep"], "segment parallel: the sequence's part per rank")
    if sequence is not None and layout.sequence_parallel and (sequence // d["sep"]) % d["mp"]:
        refuse("seq_len", sequence, d["sep"] * d["mp"], "sequence parallel over the tensor-parallel ranks")
    experts = _size(args, flags, "experts")
    if experts is not None and experts % d["ep"]:
        refuse("experts", experts, d["ep"], "expert parallel: experts per rank")
    microbatches = _size(args, flags, "accumulate")
    if microbatches is not None and d["vp"] > 1 and (microbatches < d["pp"] or microbatches % d["pp"]):
        refuse("accumulate", microbatches, d["pp"], f"the {d['pp']} stages of the interleaved schedule (vp): "
               "microbatches a step")
