"""A layout's record against one process's: losses step by step, step 1's gradients, parameters
after step 1 and at the end, and what the differences say (findings), from the files
:mod:`paddle_hybrid.dygraph.verify_record` wrote.

The rule separates rounding from defects (``docs/verify.md`` has the reasoning and the measured
margin):

* **Losses**: ``|a - b| <= atol + rtol * |b|`` (NumPy's ``isclose``), ``b`` one process's.
* **Step 1's gradients**, as the optimizer applied them (after every reduction and clipping),
  whole, per parameter: the largest difference at most ``gradient_rtol`` times the largest
  element of one process's (:func:`gradients_agree`).  Before any update, nothing has amplified
  rounding yet: a layout's gradient differs by summation order only, a defect (a missing
  reduction, a partial or doubly counted gradient, a wrong clipping norm) by a share of the
  gradient itself.
* **Parameters**, element by element: ``|a - b| <= atol + rtol * |b| + allowance``, the allowance
  the one-process run accumulated for that element
  (:class:`~paddle_hybrid.dygraph.verify_record.RoundingAllowance`): about zero for an element
  with a gradient of its own, up to twice the step's largest update of its tensor for one whose
  gradient is rounding, which Adam turns into a visible share of an update (:func:`tolerance`).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import numpy as np

from ..common.replicas import compare as compare_replicas

__all__ = ["Record", "load", "Verdict", "compare", "gradients_agree", "tolerance"]


@dataclasses.dataclass
class Record:
    ranks: dict  # rank -> its JSON record
    params: dict  # label -> {name: whole array}
    tied_conflicts: list  # (label, name, ranks): a name two pipeline stages hold with different values
    # (the first stage's is compared; a weight the pipeline ties is judged by the replica digests)
    shapes: dict  # label -> {name: {"local": shape, "split": bool}} (from one rank per name)
    aliases: dict  # other name -> name, for a parameter held under two names (tied)
    grads: dict  # name -> whole gradient of step 1 as the optimizer applied it ("name::by_part" candidates too)
    allowances: dict  # label -> {name: each element's rounding allowance} (the one-process run's)
    places: dict = dataclasses.field(default_factory=dict)  # name -> {"stage", "chunk"} (a pipeline's)


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
    shapes, aliases, places = {}, {}, {}
    for record in ranks.values():
        for label, described in record.get("replicas", {}).items():
            for name, shape in described.get("shapes", {}).items():
                shapes.setdefault(label, {}).setdefault(name, shape)
            aliases.update(described.get("aliases", {}))
            for name, place in described.get("places", {}).items():
                places.setdefault(name, place)
    allowances = {}
    for path in glob.glob(os.path.join(directory, "allowance.rank*.npz")):
        label = re.match(r".*allowance\.rank\d+\.(\w+)\.npz$", path).group(1)
        with np.load(path) as data:
            allowances.setdefault(label, {}).update({name: data[name] for name in data.files})
    return Record(ranks, params, conflicts, shapes, aliases, _load_gradients(directory, ranks), allowances, places)


def _load_gradients(directory: str, ranks: dict) -> dict:
    """Step 1's whole gradients from the slices every rank recorded: a name held whole is
    taken from the lowest rank that has it, a slice joined from the lowest rank of each place
    in the tensor-parallel group."""
    from ..common.logical_params import join

    held = {}  # name -> [(rank, meta)]
    for rank in sorted(ranks):
        for name, meta in ranks[rank].get("gradients", {}).items():
            held.setdefault(name, []).append((rank, meta))
    files = {}
    for rank in {r for entries in held.values() for r, _ in entries}:
        path = os.path.join(directory, f"grads.rank{rank}.npz")
        if os.path.exists(path):
            with np.load(path) as data:
                files[rank] = {name: data[name] for name in data.files}
    grads = {}
    for name, entries in held.items():
        entries = [(r, m) for r, m in entries if name in files.get(r, {})]
        if not entries:
            continue
        rank, meta = entries[0]
        if meta.get("shard"):
            joined = _join_shards(name, entries, files)
            if joined is not None:
                grads[name] = joined
            continue
        if meta["axis"] is None:
            grads[name] = files[rank][name]
            continue
        by_place = {}
        for r, m in entries:
            by_place.setdefault(m["mp_rank"], r)
        if len(by_place) != meta["mp_size"]:
            continue  # a slice nobody recorded: no whole gradient to compare
        slices = [files[by_place[place]][name] for place in range(meta["mp_size"])]
        for variant, value in join(slices, meta["axis"], meta["parts"]).items():
            grads[name + (VARIANT + variant if variant else "")] = value
    return grads


def _join_shards(name: str, entries: list, files: dict):
    """A group-sharded stage-3 parameter's whole gradient from its slices (one a rank of the
    group, in group order, the parameter flattened and padded at the end), or None if a slice is
    missing."""
    by_place = {}
    for r, m in entries:
        by_place.setdefault(m["shard"]["rank"], r)
    shard = entries[0][1]["shard"]
    if len(by_place) != shard["size"]:
        return None
    flat = np.concatenate([files[by_place[place]][name].reshape(-1) for place in range(shard["size"])])
    return flat[:int(np.prod(shard["shape"]))].reshape(shard["shape"])


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
    first_step: int | None  # the first step whose loss differs (1 when step 1's gradients or parameters do)
    loss_diff: float  # the largest relative loss difference
    param_diff: dict  # label -> largest parameter difference relative to its tensor's largest magnitude
    diverging: dict  # label ("grads", "step1", "end") -> [(name, measure)] beyond the tolerance, worst first
    findings: list  # sentences
    grad_diff: float | None = None  # the largest gradient difference relative to its tensor's largest element
    grads_compared: int = 0  # parameters whose step-1 gradients were compared
    closest: dict = dataclasses.field(default_factory=dict)  # label -> the element nearest its tolerance
    largest: dict = dataclasses.field(default_factory=dict)  # label -> the element that differs most
    # a layout's parameters never trained there and not parameters in one process (buffers there): not compared
    not_compared: list = dataclasses.field(default_factory=list)


def _relative(a, b) -> float:
    """The largest difference relative to the reference's largest magnitude (a value near zero
    in a tensor of ones is not a 1e6 "relative" difference)."""
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def _close(a, b, rtol, atol) -> bool:
    return bool(np.all(np.isclose(np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64"), rtol=rtol, atol=atol)))


def gradients_agree(got, ref, gradient_rtol: float) -> tuple[bool, float]:
    """``(agree, difference)``: the largest element difference of two whole gradients relative
    to the reference's largest element, and whether it is at most ``gradient_rtol``.  Relative to
    the tensor, not the element: an element that is a sum of cancelling terms carries a rounding
    error of the size of its terms, not of itself."""
    got, ref = np.asarray(got, dtype="float64"), np.asarray(ref, dtype="float64")
    if ref.size == 0:
        return True, 0.0
    scale = float(np.max(np.abs(ref)))
    diff = float(np.max(np.abs(got - ref)))
    if scale == 0.0:
        return diff == 0.0, 0.0 if diff == 0.0 else float("inf")
    return diff <= gradient_rtol * scale, diff / scale


def tolerance(ref, rtol: float, atol: float, allowance=None):
    """Each element's tolerance: ``atol + rtol * |ref|`` plus its rounding allowance, if the
    one-process run recorded one of this shape (else none: a tight comparison)."""
    ref = np.asarray(ref, dtype="float64")
    tol = atol + rtol * np.abs(ref)
    if allowance is not None and np.shape(allowance) == ref.shape:
        tol = tol + np.asarray(allowance, dtype="float64")
    return tol


WORDS = {"mp": "tensor-parallel", "dp": "data-parallel", "sharding": "sharding", "sep": "segment-parallel",
         "tied": "pipeline-tied"}


def compare(reference: Record, run: Record, mp: int, rtol: float, atol: float, gradient_rtol: float) -> Verdict:
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
    param_diff, diverging, closest, largest, untrained = {}, {}, {}, {}, set()
    grad_diff, compared, bad = _compare_gradients(reference, run, gradient_rtol)
    diverging["grads"] = bad
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
            if run.shapes.get(label, {}).get(name, {}).get("trained", True) is False:
                # never trained here, no parameter in one process: a buffer there (DeepSeek-V3's routing bias
                # is a parameter under EP only); it is not compared, and the verdict says so
                untrained.add(name)
                continue
            findings.append(f"{name}: in this layout, not in one process ({label})")
        worst, bad = 0.0, []
        allowances = reference.allowances.get(label, {})
        for name in sorted(set(ref) & set(got)):
            if ref[name].shape != got[name].shape:
                findings.append(_shape_finding(name, got[name].shape, ref[name].shape, run.shapes.get(label, {}), mp))
                bad.append((name, float("inf")))
                continue
            worst = max(worst, _relative(got[name], ref[name]))
            a, b = np.asarray(got[name], dtype="float64"), np.asarray(ref[name], dtype="float64")
            if not a.size:
                continue
            tol = tolerance(b, rtol, atol, allowances.get(name))
            diff = np.abs(a - b)
            share = diff / tol
            at, most = int(np.argmax(share)), int(np.argmax(diff))
            grad = reference.grads.get(name)
            grad = grad if grad is not None and grad.shape == b.shape else None
            if label not in closest or share.flat[at] > closest[label]["share"]:
                closest[label] = _element(name, at, b, diff, tol, grad, rtol, atol)
            if label not in largest or diff.flat[most] > largest[label]["diff"]:
                largest[label] = _element(name, most, b, diff, tol, grad, rtol, atol)
            if share.flat[at] > 1.0:
                bad.append((name, _relative(a, b)))
        param_diff[label] = worst
        diverging[label] = sorted(bad, key=lambda item: -item[1])
    if diverging["grads"] or diverging["step1"]:
        first_step = 1  # step 1 already applied something else than one process did
    started = _start_differences(reference, run, rtol, atol)
    if started:
        first_step = 1
        findings.append(f"the layout starts from another model: {len(started)} parameters differ before the first "
                        f"update: {_listed(started[:5])}{f' and {len(started) - 5} more' if len(started) > 5 else ''}")
    findings += _replica_findings(run)
    findings += _partition_findings(reference, run)
    findings += _chunk_findings(run, started or [n for label in ("grads", "step1") for n, _ in diverging[label]])
    equal = first_step is None and not findings and not any(diverging.values())
    return Verdict(equal, first_step, loss_diff, param_diff, diverging, _unique(findings), grad_diff, compared,
                   closest, largest, sorted(untrained))


def _element(name, index, ref, diff, tol, grad, rtol, atol) -> dict:
    """One parameter element's difference and what its tolerance is made of (what "equal within
    rounding" prints): the plain part, its rounding allowance, its step-1 gradient against the
    tensor's largest."""
    return {"name": name, "index": [int(i) for i in np.unravel_index(index, ref.shape)],
            "share": float(diff.flat[index] / tol.flat[index]), "diff": float(diff.flat[index]),
            "tolerance": float(tol.flat[index]),
            "allowance": float(tol.flat[index] - atol - rtol * abs(ref.flat[index])),
            "gradient": None if grad is None else float(grad.flat[index]),
            "largest_gradient": None if grad is None else float(np.max(np.abs(grad)))}


def _compare_gradients(reference: Record, run: Record, gradient_rtol: float) -> tuple:
    """``(largest difference or None, parameters compared, [(name, difference)] beyond the
    tolerance)``: step 1's gradients, every parameter both runs recorded one for at one shape
    (a parameter of another shape is a finding of the parameters' comparison)."""
    got = _by_reference_names(_pick_variants(run.grads, reference.grads), reference)
    largest, compared, bad = None, 0, []
    for name in sorted(set(reference.grads) & set(got)):
        if VARIANT in name or reference.grads[name].shape != got[name].shape:
            continue
        agree, diff = gradients_agree(got[name], reference.grads[name], gradient_rtol)
        largest, compared = max(largest or 0.0, diff), compared + 1
        if not agree:
            bad.append((name, diff))
    return largest, compared, sorted(bad, key=lambda item: -item[1])


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
                    "sep": "segment-parallel replicas differ: a gradient not summed over the sep group",
                    "tied": "tied across pipeline stages, but the stages differ: its gradients are not summed"}[kind]
            if kind in ("dp", "sharding") and _is_expert(run, name, ranks):
                what = ("the replicas of an expert (the ranks holding it: the same place in their expert-parallel "
                        "groups) differ: its gradient was not reduced over them")
            out.append(f"{name}: differs within the {WORDS[kind]} group {list(ranks)} after "
                       f"{'step 1' if label == 'step1' else 'the last step'} (ranks {list(groups.values())}): {what}")
    return out


def _is_expert(run: Record, name: str, ranks) -> bool:
    return any(name in run.ranks[r].get("replicas", {}).get("step1", {}).get("experts", ()) for r in ranks
               if r in run.ranks)


def _partition_findings(reference: Record, run: Record) -> list:
    """A parameter no rank of its sharding group updated at step 1: each rank of a sharding group
    applies the step to its own partition of the parameters, and this one is in none (one
    process applied a gradient to it)."""
    out, seen = [], set()
    for entry in run.ranks.values():
        described = entry.get("replicas", {}).get("step1", {})
        group = tuple(described.get("groups", {}).get("sharding", ()))
        if len(group) < 2 or group in seen or not all(r in run.ranks for r in group):
            continue
        seen.add(group)
        held, applied = set(), set()
        for r in group:
            held.update(run.ranks[r].get("replicas", {}).get("step1", {}).get("digests", {}))
            applied.update(run.ranks[r].get("gradients", {}))
        for name in sorted((held & set(reference.grads)) - applied):
            out.append(f"{name}: in no partition of the sharding group {list(group)}: each rank updates its own "
                       f"share of the parameters, and no rank applied {name}'s step-1 gradient, which one process "
                       f"did (so it is never trained)")
    return out


def _start_differences(reference: Record, run: Record, rtol: float, atol: float) -> list:
    """The parameters that differ from one process's before the first update (both runs record
    them then), by name."""
    ref = reference.params.get("start", {})
    got = _by_reference_names(_pick_variants(run.params.get("start", {}), ref), reference)
    return sorted(name for name in set(ref) & set(got)
                  if ref[name].shape == got[name].shape and not _close(got[name], ref[name], rtol, atol))


def _chunk_findings(run: Record, differing: list) -> list:
    """Where the parameters that differ are (those of the start if any, else step 1's), when a
    virtual pipeline holds them all in some of its chunks and every parameter of the other
    chunks agrees."""
    chunked = {name: place["chunk"] for name, place in run.places.items() if place.get("chunk") is not None}
    bad = {name for name in differing if name in chunked}
    if not bad:
        return []
    chunks = sorted({chunked[name] for name in bad})
    others = sorted(set(chunked.values()) - set(chunks))
    if not others:
        return []
    layers = sorted({int(name.split(".")[0]) for name in bad if name.split(".")[0].isdigit()})
    stages = sorted({run.places[name]["stage"] for name in bad})
    return [f"the parameters that differ are all in virtual chunk {_listed(chunks)} of pipeline stages "
            f"{_listed(stages)} (layers {_listed(layers)}); every parameter of chunk {_listed(others)} agrees: what "
            f"a virtual chunk holds differs from one process's layers there"]


def _listed(values) -> str:
    return ", ".join(str(v) for v in values)


def _unique(items: list) -> list:
    seen, out = set(), []
    for item in items:
        key = item.split(" after ")[0] if " differs within " in item else item
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out
