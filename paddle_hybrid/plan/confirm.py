"""``plan --dryrun-top K``: the K fastest layouts that fit, each dry-run at its real size (``python -m
paddle_hybrid.dryrun --gpu``, with ``--compose-layers`` where a chunk has 3 layers or more, and the pipeline's
own stages' worth of microbatches measured): the step priced again from the kernels each class's run recorded,
and the memory the run measured (its GPU estimate), beside the plan's figures.

A script takes a layout through the flags it declares (``PADDLE_HYBRID_LAYOUT_FLAGS``: ``examples/gpt_pp.py``),
the degrees, micro-batch size and microbatches a step given, ``--recompute`` and the sequence-parallel switch
where the layout asks them, 2 optimizer steps (the dry run measures the second); other scripts are refused by
name.
"""
from __future__ import annotations

import json
import os
import tempfile

from ..common.script_kind import kind_of, script_flags

__all__ = ["dryrun_args", "confirm"]

_RECOMPUTE = {"none": "none", "sel": "selective", "full": "full"}


def dryrun_args(script: str, args: list, layout, global_batch: int) -> list:
    """The script's arguments for ``layout``; ValueError naming what the script cannot take."""
    with open(script) as f:
        source = f.read()
    flags = script_flags(source)
    if kind_of(source) != "flags" or not flags:
        raise ValueError(f"{script}: --dryrun-top takes a script that declares its layout flags "
                         "(PADDLE_HYBRID_LAYOUT_FLAGS, as examples/gpt_pp.py); dry-run this one yourself with "
                         "python -m paddle_hybrid.dryrun --gpu")
    need = {"mp": layout.tp, "pp": layout.pp, "vp": layout.vp, "dp": layout.dp, "sharding": layout.sharding}
    missing = [k for k, v in need.items() if v > 1 and k not in flags] + \
        [k for k in ("batch", "accumulate") if k not in flags]
    if layout.sp and "sp" not in flags:
        missing.append("sp")
    if missing:
        raise ValueError(f"{script}: its PADDLE_HYBRID_LAYOUT_FLAGS has no {missing}: it cannot take {layout.name()}")
    out = list(args)
    for key, value in need.items():
        if key in flags:
            out += [flags[key], str(value)]
    micro = global_batch // (layout.replicas * layout.mbs)
    out += [flags["batch"], str(layout.mbs), flags["accumulate"], str(micro), "--recompute",
            _RECOMPUTE[layout.recompute]]
    if layout.sp:
        out.append(flags["sp"])
    if "steps" in flags:  # the dry run measures step 2: more would only take longer
        out += [flags["steps"], "2"]
    return out


def confirm(estimates, top: int, script: str, args: list, clus, global_batch: int, layers: int, work=None) -> list:
    """Dry-run the ``top`` fastest fitting layouts; ``[{"layout", "plan_step_s", "dryrun_step_s", "plan_peak_bytes",
    "plan_allocated_bytes", "dryrun_gpu_estimate_bytes", "exit"}]`` (exit: the dry run's; its figures None where it
    failed)."""
    from ..dryrun import cli as dryrun_cli

    rows = []
    work = work or tempfile.mkdtemp(prefix="paddle_hybrid_plan_")
    for e in [e for e in estimates if e.fits][:top]:
        layout = e.layout
        out = os.path.join(work, f"{layout.name()}.json")
        chunks = layout.pp * layout.vp
        argv = ["--nnodes", str(clus.nodes), "--nproc_per_node", str(clus.gpus_per_node), "--gpu",
                _gpu_key(clus.gpu), "--json", out]
        if layers // chunks >= 3:
            argv.append("--compose-layers")
        micro = global_batch // (layout.replicas * layout.mbs)
        if micro > layout.pp and layout.vp == 1:
            argv += ["--measure-microbatches", str(layout.pp)]
        code = dryrun_cli.main(argv + [script] + dryrun_args(script, args, layout, global_batch))
        row = {"layout": layout.name(), "plan_step_s": e.step_time_s, "plan_peak_bytes": e.peak_bytes_per_gpu,
               "plan_allocated_bytes": max(s["allocated_bytes"] for s in e.per_stage),
               "exit": code, "dryrun_step_s": None, "dryrun_gpu_estimate_bytes": None}
        if code == 0:
            with open(out) as f:
                report = json.load(f)
            row["dryrun_step_s"] = report["gpu_step"]["step_time_s"]
            row["dryrun_gpu_estimate_bytes"] = max(c["gpu_estimate"]["composed_peak_bytes"]
                                                   for c in report["rank_classes"])
        rows.append(row)
    return rows


def _gpu_key(gpu) -> str:
    from .hardware import GPUS

    return next(key for key, g in GPUS.items() if g is gpu)
