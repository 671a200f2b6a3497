"""Layouts as the verifier's command line names them, and how each becomes a run of the script.

A layout is degrees joined: ``tp2`` (tensor parallel), ``pp2`` (pipeline), ``dp2`` (data
parallel), ``sharding2`` (sharding stage 1), ``sp2`` (tensor parallel 2 with sequence parallel),
``tp2pp2``, ``dp2tp2`` ...; its processes are the product of the degrees.

How a script takes a layout depends on what the script is (:func:`kind_of`):

* ``trainer`` (PaddleFormers' ``TrainingArguments`` in the script): the Trainer's own flags
  (``--tensor_model_parallel_size``, ``--pipeline_model_parallel_size``, ``--sharding stage1
  --sharding_parallel_size``, ``--sequence_parallel true``); data parallel is what is left of the
  processes.  ``--per_device_train_batch_size`` is divided by the data-parallel replicas, so every
  layout trains the same global batch as one process.
* ``flags``: the script declares how it takes degrees, in a module-level dict
  ``PADDLE_HYBRID_LAYOUT_FLAGS = {"mp": "--mp", "pp": "--pp", "dp": "--dp", "sharding": "--sharding",
  "sp": "--sequence-parallel", "batch": "--micro-batch-size"}`` (read from its source, not run;
  ``examples/gpt_pp.py`` has one); ``batch`` is divided as above.
* ``fleet``: anything else: the plugin puts the degrees into the strategy ``fleet.init`` gets, and
  draws every weight again by its name (``seeded_init``), so every layout starts from one model.
  Such a script must feed each data-parallel replica its share of the batch itself.
"""
from __future__ import annotations

import re

from ..common.script_kind import kind_of, script_flags  # noqa: F401  (this module's API)

__all__ = ["Layout", "parse_layouts", "kind_of", "script_flags", "layout_args", "LayoutError"]

TRAINER_DEFAULT_BATCH = "8"  # TrainingArguments' per_device_train_batch_size when not given
_PART = re.compile(r"(tp|mp|pp|dp|sharding|sp)(\d+)")
KINDS = ("trainer", "flags", "fleet")


class LayoutError(ValueError):
    """A layout the verifier cannot make; the message says what to write instead."""


class Layout:
    """One layout: ``name`` as given and its degrees ``{"mp", "pp", "dp", "sharding"}`` plus
    ``sp`` (sequence parallel on)."""

    def __init__(self, name: str):
        self.name = name
        self.degrees = {"mp": 1, "pp": 1, "dp": 1, "sharding": 1}
        self.sequence_parallel = False
        pos = 0
        for match in _PART.finditer(name):
            if match.start() != pos:
                break
            kind, n = match.group(1), int(match.group(2))
            if n < 1:
                raise LayoutError(f"layout {name!r}: degree {n} of {kind} must be at least 1")
            if kind == "sp":
                kind, self.sequence_parallel = "mp", True
            self.degrees["mp" if kind == "tp" else kind] = n
            pos = match.end()
        if pos != len(name) or not name:
            raise LayoutError(f"layout {name!r}: write degrees joined, e.g. tp2, pp2, dp2, sharding2, sp2, tp2pp2")
        if self.sequence_parallel and self.degrees["mp"] < 2:
            raise LayoutError(f"layout {name!r}: sequence parallel needs tensor parallel of 2 or more (sp2)")

    @property
    def nprocs(self) -> int:
        d = self.degrees
        return d["mp"] * d["pp"] * d["dp"] * d["sharding"]

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (data parallel times sharding): each takes a share of the batch."""
        return self.degrees["dp"] * self.degrees["sharding"]

    def __repr__(self):
        return f"Layout({self.name!r})"


def parse_layouts(text: str) -> list:
    layouts = [Layout(part.strip()) for part in text.split(",") if part.strip()]
    if not layouts:
        raise LayoutError("--layouts: give at least one layout, e.g. --layouts tp2,pp2,dp2")
    return layouts


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
    """The script's arguments for ``layout`` (None: one process)."""
    if kind == "trainer":
        args = _without(list(args), ["--logging_steps"]) + ["--logging_steps", "1"]
        if layout is None:
            return args
        d = layout.degrees
        given = _value(args, "--per_device_train_batch_size", TRAINER_DEFAULT_BATCH)
        args = _without(args, ["--tensor_model_parallel_size", "--pipeline_model_parallel_size", "--sharding",
                               "--sharding_parallel_size", "--sequence_parallel", "--per_device_train_batch_size"])
        batch = _share(given, layout.replicas, "--per_device_train_batch_size", layout)
        extra = ["--per_device_train_batch_size", batch]
        if d["mp"] > 1:
            extra += ["--tensor_model_parallel_size", str(d["mp"])]
        if d["pp"] > 1:
            extra += ["--pipeline_model_parallel_size", str(d["pp"])]
        if d["sharding"] > 1:
            extra += ["--sharding", "stage1", "--sharding_parallel_size", str(d["sharding"])]
        if layout.sequence_parallel:
            extra += ["--sequence_parallel", "true"]
        return args + extra
    if kind == "flags":
        degrees = layout.degrees if layout is not None else {"mp": 1, "pp": 1, "dp": 1, "sharding": 1}
        out = _without(list(args), [flags[k] for k in ("mp", "pp", "dp", "sharding", "batch") if k in flags])
        out = [a for a in out if a != flags.get("sp")]
        for key in ("mp", "pp", "dp", "sharding"):  # every degree stated: the script's defaults may be others
            if key in flags:
                out += [flags[key], str(degrees[key])]
            elif degrees[key] > 1:
                raise LayoutError(f"layout {layout.name}: the script's PADDLE_HYBRID_LAYOUT_FLAGS has no {key!r}")
        if layout is not None and layout.sequence_parallel:
            out.append(flags["sp"])
        given = _value(list(args), flags["batch"]) if "batch" in flags else None
        if given is not None:
            out += [flags["batch"], _share(given, layout.replicas, flags["batch"], layout) if layout else given]
        elif layout is not None and layout.replicas > 1 and "batch" in flags:
            raise LayoutError(f"layout {layout.name}: give {flags['batch']} on the command line, so the verifier "
                              f"can split it over the {layout.replicas} data-parallel replicas")
        return out
    return list(args)

