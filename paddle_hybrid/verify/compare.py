"""A layout's record against one process's: losses step by step, parameters after step 1 and at the
end, and what the differences say (findings), from the files
:mod:`paddle_hybrid.dygraph.verify_record` wrote.

Tolerances: two values agree when ``|a - b| <= atol + rtol * |b|`` (NumPy's ``isclose``), the
reference ``b`` from one process.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import numpy as np

from ..common.replicas import compare as compare_replicas

__all__ = ["Record", "load", "Verdict", "compare"]


@dataclasses.dataclass
class Record:
    ranks: dict  # rank -> its JSON record
    params: dict  # label -> {name: whole array}
    tied_conflicts: list  # (label, name, ranks): a name two pipeline stages hold with different values
    # (the first stage's is compared; a weight the pipeline ties is judged by the replica digests)
    shapes: dict  # label -> {name: {"local": shape, "split": bool}} (from one rank per name)
    aliases: dict  # other name -> name, for a parameter held under two names (tied)


def load(directory: str) -> Record:
    ranks = {}
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        with open(path) as f:
            record = json.load(f)
        ranks[int(record["rank"])] = record
    params, owners, conflicts = {}, {}, []
    for path in sorted(glob.glob(os.path.join(directory, "params.rank*.npz"))):
        rank, label = re.match(r".*params\.rank(\d+)\.(\w+)\.npz$", path).groups()
        with np.load(path) as data:
            for name in data.files:
                held = params.setdefault(label, {})
                if name in held and (held[name].shape != data[name].shape or not np.array_equal(held[name], data[name])):
                    conflicts.append((label, name, [owners[label][name], int(rank)]))
                held.setdefault(name, data[name])
                owners.setdefault(label, {}).setdefault(name, int(rank))
    shapes, aliases = {}, {}
    for record in ranks.values():
        for label, described in record.get("replicas", {}).items():
            for name, shape in described.get("shapes", {}).items():
                shapes.setdefault(label, {}).setdefault(name, shape)
            aliases.update(described.get("aliases", {}))
    return Record(ranks, params, conflicts, shapes, aliases)


VARIANT = "::"  # verify_record.VARIANT: "name::by_part" is another candidate whole value of "name"


def _pick_variants(got: dict, ref: dict) -> dict:
    """One value a name: of a fused projection's candidates, the one closest to the reference."""
    out = {name: value for name, value in got.items() if VARIANT not in name}
    for key, value in got.items():
        if VARIANT not in key:
            continue
        name = key.split(VARIANT)[0]
        if name in ref and name in out and value.shape == ref[name].shape and \
                _relative(value, ref[name]) < _relative(out[name], ref[name]):
            out[name] = value
    return out


def _by_reference_names(got: dict, reference: Record) -> dict:
    """``got`` with each name the one process holds under another name (a tied weight) renamed
    to that name; two of them must then agree, which the comparison checks as one."""
    out = {}
    for name, value in got.items():
        out.setdefault(reference.aliases.get(name, name), value)
    return out


def step_losses(record: Record) -> dict:
    """``{step: loss}`` of a run: the mean over data-parallel replicas (tensor-parallel rank 0 of
    the last pipeline stage) of each one's loss; one process: its own."""
    per_step = {}
    for entry in record.ranks.values():
        c = entry["coords"]
        if c["mp"] != 0 or c["pp"] != c.get("pp_size", 1) - 1:
            continue
        for step, loss in entry["losses"].items():
            per_step.setdefault(int(step), []).append(loss)
    return {step: float(np.mean(values)) for step, values in sorted(per_step.items())}


@dataclasses.dataclass
class Verdict:
    equal: bool
    first_step: int | None  # the first step whose loss differs
    loss_diff: float  # the largest relative loss difference
    param_diff: dict  # label -> largest relative parameter difference
    diverging: dict  # label -> [(name, max relative difference)] beyond the tolerance, largest first
    findings: list  # sentences


def _relative(a, b) -> float:
    """The largest difference relative to the reference's largest magnitude (a value near zero
    in a tensor of ones is not a 1e6 "relative" difference)."""
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def _close(a, b, rtol, atol) -> bool:
    return bool(np.all(np.isclose(np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64"), rtol=rtol, atol=atol)))


WORDS = {"mp": "tensor-parallel", "dp": "data-parallel", "sharding": "sharding", "tied": "pipeline-tied"}


def compare(reference: Record, run: Record, mp: int, rtol: float, atol: float) -> Verdict:
    findings = []
    ref_losses, losses = step_losses(reference), step_losses(run)
    first_step, loss_diff = None, 0.0
    for step in sorted(set(ref_losses) | set(losses)):
        if step not in losses or step not in ref_losses:
            first_step = first_step or step
            findings.append(f"step {step} has a loss in {'one process' if step in ref_losses else 'this layout'} only")
            continue
        loss_diff = max(loss_diff, _relative(losses[step], ref_losses[step]))
        if first_step is None and not _close(losses[step], ref_losses[step], rtol, atol):
            first_step = step
    param_diff, diverging = {}, {}
    for label in ("step1", "end"):
        ref = reference.params.get(label, {})
        held = _pick_variants(run.params.get(label, {}), ref)
        got = _by_reference_names(held, reference)
        for name, value in held.items():
            first = reference.aliases.get(name)
            if first in held and first != name and (held[first].shape != value.shape or
                                                    not _close(value, held[first], rtol, atol)):
                findings.append(f"{name} and {first}: one parameter in one process (tied), different values in "
                                f"this layout ({label}): the tie is not kept")
        for name in sorted(set(ref) - set(got)):
            findings.append(f"{name}: in one process, not in this layout ({label})")
        for name in sorted(set(got) - set(ref)):
            findings.append(f"{name}: in this layout, not in one process ({label})")
        worst, bad = 0.0, []
        for name in sorted(set(ref) & set(got)):
            if ref[name].shape != got[name].shape:
                findings.append(_shape_finding(name, got[name].shape, ref[name].shape, run.shapes.get(label, {}), mp))
                bad.append((name, float("inf")))
                continue
            rel = _relative(got[name], ref[name])
            worst = max(worst, rel)
            if not _close(got[name], ref[name], rtol, atol):
                bad.append((name, rel))
        param_diff[label] = worst
        diverging[label] = sorted(bad, key=lambda item: -item[1])
    findings += _replica_findings(run)
    equal = first_step is None and not findings and not any(diverging.values())
    return Verdict(equal, first_step, loss_diff, param_diff, diverging, _unique(findings))


def _shape_finding(name, shape, ref_shape, shapes, mp) -> str:
    local = shapes.get(name, {})
    if mp > 1 and not local.get("split") and len(shape) == len(ref_shape):
        axes = [i for i, (a, b) in enumerate(zip(shape, ref_shape)) if a != b]
        if len(axes) == 1 and shape[axes[0]] * mp == ref_shape[axes[0]]:
            return (f"{name}: sized per rank but not marked distributed: {list(shape)} on each of the {mp} "
                    f"tensor-parallel ranks, {list(ref_shape)} in one process, and no is_distributed / split_axis, "
                    f"so each rank trains its own slice as if it were the whole parameter")
    return f"{name}: shape {list(shape)} in this layout, {list(ref_shape)} in one process"


def _replica_findings(run: Record) -> list:
    out = []
    for label in ("step1", "end"):
        published = {rank: entry["replicas"][label] for rank, entry in run.ranks.items()
                     if label in entry.get("replicas", {})}
        for kind, ranks, name, values in compare_replicas(published):
            groups = {}
            for rank, digest in values:
                groups.setdefault(digest, []).append(rank)
            what = {"mp": "held whole by every tensor-parallel rank, yet different on some: a missing all-reduce "
                          "(a partial gradient on each rank), or a parameter sized per rank but not marked distributed",
                    "dp": "data-parallel replicas differ: a gradient not all-reduced",
                    "sharding": "sharding replicas differ: an update not sent to every rank",
                    "tied": "tied across pipeline stages, but the stages differ: its gradients are not summed"}[kind]
            out.append(f"{name}: differs within the {WORDS[kind]} group {list(ranks)} after "
                       f"{'step 1' if label == 'step1' else 'the last step'} (ranks {list(groups.values())}): {what}")
    return out


def _unique(items: list) -> list:
    seen, out = set(), []
    for item in items:
        key = item.split(" after ")[0] if " differs within " in item else item
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out
