"""The dry run's report: per rank class what it holds (measured), what the schedule keeps in flight
(composed), what it moves per step (measured), as a table and as JSON for a user's CI.

JSON: ``{"world", "nnodes", "nproc_per_node", "degrees", "errors": [{"field", "message"}],
"rank_classes": [{"class", "ranks", "representative", "parameters_bytes", "gradients_bytes",
"optimizer_bytes", "activations_bytes", "activations_bytes_per_microbatch", "microbatches",
"in_flight_microbatches", "peak_bytes", "peak_window", "composed_peak_bytes", "communication": [{"op",
"group", "calls", "bytes"}], "wall_s", "max_rss_bytes", "derived_from", "routing", "gpu_estimate": {...}}],
"wall_s", "notes": [...]}``; bytes are integers; every rank of the world is in exactly one class.  ``derived_from`` is null for a class
whose representative ran, else the rank whose run it was derived from (:func:`derived_entry`).
An error of a rank's run (a script that ended before the measured step, its second optimizer step) also
has ``"rank"`` and ``"class"``; ``rank_classes`` is then empty.
``routing`` is the probe's (how the class's MoE gates routed: forced-balanced), null where no gate routed.
``experts`` (null where no gate routed): what the class's MoE layers hold and move, a step of forced-balanced
routing: ``routing`` (its mode), ``moe_layers`` (the layers that routed), ``experts_per_layer``, ``experts_held``
(their sum: the experts this rank holds), ``expert_parameters_bytes`` (their parameters), as the probe found them
(:mod:`paddle_hybrid.common.routing_record`; null where it found no layer), and ``all_to_all_bytes`` /
``all_to_all_calls`` of step 2 (the communication log's ``all_to_all`` entries: the token exchanges and any
count exchange, each call's tensor as logged) (:func:`experts_entry`).
``checkpoint_loads`` is the probe's (each checkpoint load the fake world answered without reading it:
``path``, ``format``, ``tensors`` and ``bytes`` of the rank, ``files``, ``file_bytes``, ``largest_file_bytes``,
``weights_read`` false), null where the script loaded none; the notes then name each directory not read.
``fused_fsdp``: Paddle's fused FSDP (PaddleFormers' ``--enable_auto_parallel 1``), null without it: ``group`` (the
FSDP group's global ranks), ``buffers`` (per fused group: ``parameters``, ``dtype``, ``element_bytes``, ``elements``
whole, ``piece_elements`` this rank's, ``gradient_dtype``, ``gradient_element_bytes``, ``gradient_piece_elements``),
``gathered_parameters_bytes`` and ``gathered_gradients_bytes`` (:func:`fused_fsdp_summary`), which
``composed_peak_bytes`` adds.
``gpu_estimate``: the same class on a GPU in bfloat16 with flash attention, estimated, not measured
(:mod:`.gpu_estimate`).

Measured: parameters, gradients, optimizer state (bytes of this rank's tensors), activations saved
for backward in step 2 (per microbatch: divided by its backward calls), the allocator's peak in step
2, the communication of step 2.  Composed: ``in_flight_microbatches`` (1F1B keeps ``stages - stage``
microbatches' activations of stage ``stage``; the interleaved schedule ``((stages - stage - 1) * 2 +
(chunks - 1) * (microbatches % stages + stages) + 1)`` chunk forwards of ``1 / chunks`` of a microbatch
each, as Paddle's ``PipelineParallelWithInterleave`` starts), and
``composed_peak_bytes`` = parameters + gradients + optimizer state + in-flight activations: where the
real peak cannot be run, the figure to read.
"""
from __future__ import annotations

import json

from . import gpu_estimate
from .classes import corresponding_group, describe_ranks

GPU_MEMORY_BYTES = 80 * 10**9  # an 80 GB device (the dry run's --gpu-memory)

__all__ = ["class_entry", "derived_entry", "in_flight", "table", "write_json", "gib", "checkpoint_notes",
           "experts_entry", "expert_lines", "ROUTING_KEYS"]

# what the probe's ``routing`` says of the gates; the rest of it is the experts' (experts_entry)
ROUTING_KEYS = ("mode", "gate_calls", "top_k", "tokens_per_expert")


def _total(by_dtype) -> int:
    return int(sum((by_dtype or {}).values()))


def in_flight(stage: int, stages: int, chunks: int, microbatches: int) -> float:
    """Microbatches' activations the schedule keeps at once on ``stage`` (see the module docstring)."""
    if stages <= 1:
        return 1.0 if microbatches else 0.0
    if chunks <= 1:
        return float(min(stages - stage, microbatches))
    first_chunk = microbatches % stages + stages  # microbatches the schedule runs through the first chunk first
    forwards = min((stages - stage - 1) * 2 + (chunks - 1) * first_chunk + 1, microbatches * chunks)
    return forwards / chunks


def _communication(probe) -> list:
    log = probe.get("communication") or []
    marks = probe.get("comm_marks") or []
    window = log[marks[0]:marks[1]] if len(marks) >= 2 else log
    summary = {}
    for entry in window:
        key = (entry["op"], tuple(entry["group"]) if entry.get("group") is not None else None)
        calls, nbytes = summary.get(key, (0, 0))
        summary[key] = (calls + 1, nbytes + int(entry["bytes"]))
    return [{"op": op, "group": list(group) if group is not None else None, "calls": calls, "bytes": nbytes}
            for (op, group), (calls, nbytes) in sorted(summary.items(), key=lambda kv: (kv[0][0], kv[0][1] or ()))]


def class_entry(rank_class, run, stages: int, schedule_microbatches: int | None = None,
                schedule_chunks: int | None = None, gpu_memory_bytes: int = GPU_MEMORY_BYTES) -> dict:
    """``schedule_microbatches``, ``schedule_chunks``: the script's own microbatches a step and virtual
    stages, where the run took fewer (``--measure-microbatches``); the schedule's in-flight count is
    composed with them."""
    probe = run.probe or {}
    topology = probe.get("topology") or {}
    stage = int(topology.get("stage", 0)) if topology else 0
    run_chunks = int(probe.get("virtual_stages", 1) or 1)
    chunks = schedule_chunks or run_chunks
    # the probe counts backward calls: the interleaved schedule makes one a chunk of a microbatch
    microbatches = int(probe.get("microbatches", 0) or 0) // run_chunks
    activations = int(probe.get("activations_bytes_per_step", 0) or 0)
    per_microbatch = activations // microbatches if microbatches else activations
    flight = in_flight(stage, stages, chunks, schedule_microbatches or microbatches)
    by_kind = {k: int(v) // microbatches if microbatches else int(v)
               for k, v in (probe.get("activations_by_kind") or {}).items()}
    params, grads, optim = (_total(probe.get(k)) for k in ("parameters", "gradients", "optimizer"))
    fsdp = fused_fsdp_summary(probe.get("fused_fsdp"))
    entry = {
        "class": rank_class.label, "ranks": rank_class.ranks, "representative": rank_class.representative,
        "parameters_bytes": params, "gradients_bytes": grads, "optimizer_bytes": optim,
        "parameters_by_dtype": probe.get("parameters", {}), "gradients_by_dtype": probe.get("gradients", {}),
        "optimizer_by_dtype": probe.get("optimizer", {}),
        "activations_bytes": activations, "activations_bytes_per_microbatch": per_microbatch,
        "microbatches": microbatches, "in_flight_microbatches": flight,
        "peak_bytes": int(probe.get("peak_bytes", 0) or 0), "peak_window": probe.get("peak_window"),
        "composed_peak_bytes": int(params + grads + optim + per_microbatch * flight + _gathered(fsdp)),
        "communication": _communication(probe), "wall_s": round(run.wall_s, 2), "max_rss_bytes": run.max_rss_bytes,
        "derived_from": None,
        # the MoE gates' (forced-balanced in a dry run); None: no gate routed
        "routing": {k: v for k, v in probe["routing"].items() if k in ROUTING_KEYS} if probe.get("routing") else None,
        # the checkpoint loads the fake world answered without reading them (gloo.fake_checkpoint); None: none
        "checkpoint_loads": probe.get("checkpoint_loads"),
        "fused_fsdp": fsdp,  # Paddle's fused FSDP (the auto-parallel path): its buffers; None: not used
        "activations_by_kind_per_microbatch": by_kind,
        # the kernels of step 2 as the probe recorded them, and the backward calls they span (the GPU step's price)
        "kernels": probe.get("kernels", []), "kernel_microbatches": int(probe.get("microbatches", 0) or 0),
        "stage": stage,
        # a static program's values kept for backward whose shape has an unknown dimension: not in the bytes
        "activations_unsized": int(probe.get("activations_unsized", 0) or 0),
        "program": probe.get("program"),  # "pir" or "legacy" for a static program; None: dygraph
    }
    entry["experts"] = experts_entry(probe.get("routing"), entry["communication"])
    entry["gpu_estimate"] = gpu_estimate.estimate(entry, gpu_memory_bytes)
    return entry


def experts_entry(routing: dict | None, communication: list) -> dict | None:
    """The class's experts and their all-to-all in step 2, from the probe's ``routing`` and the class's
    ``communication`` (:func:`_communication`); None where no gate routed."""
    if not routing:
        return None
    exchanges = [c for c in communication if c["op"] == "all_to_all"]
    return {"routing": routing.get("mode"), "moe_layers": routing.get("moe_layers"),
            "experts_per_layer": routing.get("experts_per_layer"), "experts_held": routing.get("experts_held"),
            "expert_parameters_bytes": routing.get("expert_parameters_bytes"),
            "all_to_all_bytes": sum(c["bytes"] for c in exchanges),
            "all_to_all_calls": sum(c["calls"] for c in exchanges)}


def fused_fsdp_summary(record) -> dict | None:
    """The class's fused-FSDP buffers (the probe's ``fused_fsdp``) with what a backward holds whole besides
    this rank's pieces: ``gathered_parameters_bytes`` and ``gathered_gradients_bytes``, the whole parameter
    buffer (gathered for the group's forward and backward) and the whole float32 gradient buffer (filled
    by its backward, then reduce-scattered) of the group for which they are largest together; None
    without fused FSDP."""
    if not record:
        return None
    buffers = record.get("buffers") or []
    whole = [(b["elements"] * b["element_bytes"], b["elements"] * b["gradient_element_bytes"]
              if b["gradient_piece_elements"] else 0) for b in buffers]
    params, grads = max(whole, key=sum) if whole else (0, 0)
    return dict(record, gathered_parameters_bytes=int(params), gathered_gradients_bytes=int(grads))


def _gathered(fsdp) -> int:
    return fsdp["gathered_parameters_bytes"] + fsdp["gathered_gradients_bytes"] if fsdp else 0


def derived_entry(rank_class, source: dict, partition: dict, coords: list) -> dict:
    """The entry of a sharding rank's class from its stage's measured one (``source``, sharding rank 0):
    the same parameters, gradients, activations and calls (on this class's own groups), its own share of
    the optimizer state from the partition the measured rank's optimizer made (``partition``: the probe's
    ``sharding_partition``); the peaks moved by the difference in optimizer state."""
    own = {k: int(v) for k, v in partition["optimizer_by_rank"][str(rank_class.key["sharding"])].items() if v}
    optim = sum(own.values())
    delta = optim - source["optimizer_bytes"]
    entry = dict(source)
    entry.update({
        "class": rank_class.label, "ranks": rank_class.ranks, "representative": rank_class.representative,
        "optimizer_bytes": optim, "optimizer_by_dtype": own,
        "peak_bytes": source["peak_bytes"] + delta, "composed_peak_bytes": source["composed_peak_bytes"] + delta,
        "communication": [dict(c, group=corresponding_group(c["group"], source["representative"],
                                                           rank_class.representative, coords)
                               if c["group"] is not None else None) for c in source["communication"]],
        "wall_s": 0.0, "max_rss_bytes": None, "derived_from": source["representative"],
    })
    entry["gpu_estimate"] = gpu_estimate.estimate(entry, source["gpu_estimate"]["device_bytes"])
    return entry


def gib(n) -> str:
    if n >= 2**28:
        return f"{n / 2**30:.2f}"
    return f"{n / 2**20:.1f}M" if n >= 2**20 else f"{n / 2**10:.1f}K"


def table(entries: list) -> str:
    head = ("class", "ranks", "params", "grads", "optim", "act/mb", "in flight", "peak (step 2)", "composed", "comm/step",
            "GPU est.", "of device")
    rows = [head]
    for e in entries:
        comm = sum(c["bytes"] for c in e["communication"])
        calls = sum(c["calls"] for c in e["communication"])
        rows.append((e["class"], describe_ranks(e["ranks"]), gib(e["parameters_bytes"]), gib(e["gradients_bytes"]),
                     gib(e["optimizer_bytes"]), gib(e["activations_bytes_per_microbatch"]),
                     f"{e['in_flight_microbatches']:g}",
                     f"{gib(e['peak_bytes'])} ({e['microbatches']} mb"
                     + (f", from r{e['derived_from']})" if e.get("derived_from") is not None else ")"),
                     gib(e["composed_peak_bytes"]),
                     f"{calls} calls, {gib(comm)}", gib(e["gpu_estimate"]["composed_peak_bytes"]),
                     f"{e['gpu_estimate']['composed_peak_bytes'] / e['gpu_estimate']['device_bytes']:.0%}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = ("\n(bytes: GiB, or M = MiB, K = KiB; act/mb: saved for backward per microbatch; from rN: derived from "
              f"rank N's run, see the notes;\n {gpu_estimate.ASSUMPTIONS}; of device: its composed peak's share)")
    return ("\n".join(lines) + legend + _routing_lines(entries) + _fsdp_lines(entries) + _unsized_lines(entries)
            + "".join(f"\n{n}" for n in checkpoint_notes(entries)))


def _unsized_lines(entries: list) -> str:
    """Static programs: their peak is one run's; classes whose program keeps values of an unknown size for
    backward (act/mb holds less)."""
    static = [e["class"] for e in entries if e.get("program")]
    note = (f"\nstatic program in class(es) {', '.join(static)}: peak (step 2) is this run's; Paddle's executor frees "
            "by its own schedule and the same rank's peak varied up to 2x between runs here (docs/dryrun.md); "
            "params, grads, optim, act/mb and the collectives are the program's own") if static else ""
    return note + "".join(f"\nclass {e['class']}: {e['activations_unsized']} value(s) its static program keeps for backward have "
                   "a dimension unknown before the run (-1, not the batch): left out of act/mb and composed, which "
                   "are short of them; the peak (step 2) includes them" for e in entries if e.get("activations_unsized"))


def _fsdp_lines(entries: list) -> str:
    """Which classes train under Paddle's fused FSDP, and what of it their figures hold."""
    seen, lines = set(), []
    for e in entries:
        if e.get("fused_fsdp") and e["class"] not in seen:
            seen.add(e["class"])
            lines.append(e)
    return "".join(f"\nfused FSDP in class {e['class']} (over ranks {describe_ranks(e['fused_fsdp']['group'])}, "
                   f"{len(e['fused_fsdp']['buffers'])} fused group(s)): params and grads are this rank's pieces of the "
                   f"fused buffers; composed adds the largest group gathered whole in a backward "
                   f"({gib(e['fused_fsdp']['gathered_parameters_bytes'])} parameters, "
                   f"{gib(e['fused_fsdp']['gathered_gradients_bytes'])} gradients)" for e in lines)


def _routing_lines(entries: list) -> str:
    """Which classes' MoE gates routed, and how (a dry run forces them balanced), with their experts."""
    return "".join(f"\nMoE routing {e['routing']['mode']} in class {e['class']}: tokens this rank sent each expert "
                   f"(top-{e['routing']['top_k']}, last gate call) {e['routing']['tokens_per_expert']}"
                   + (f"; {line}" if line else "")
                   for e, line in ((e, expert_line(e)) for e in entries) if e.get("routing"))


def expert_line(entry: dict) -> str:
    """What the class's experts hold and move, in words; empty without experts."""
    experts = entry.get("experts")
    if not experts:
        return ""
    held = ("experts not found" if experts["experts_held"] is None else
            f"{experts['experts_held']} expert{'' if experts['experts_held'] == 1 else 's'} held "
            f"({_per_layer(experts['experts_per_layer'])}), {gib(experts['expert_parameters_bytes'])} of parameters")
    return f"{held}; all-to-all {gib(experts['all_to_all_bytes'])} in {experts['all_to_all_calls']} calls in step 2"


def _per_layer(counts: list) -> str:
    if len(set(counts)) == 1:
        return f"{counts[0]} a layer x {len(counts)} MoE layer{'' if len(counts) == 1 else 's'}"
    return f"{', '.join(str(c) for c in counts)} in its {len(counts)} MoE layers"


def expert_lines(entries: list) -> list:
    """A note per class with experts: what it holds and moves (the JSON's ``notes``)."""
    return [f"experts in class {e['class']} ({e['experts']['routing']} routing): {expert_line(e)}" for e in entries
            if expert_line(e)]


def checkpoint_notes(entries: list) -> list:
    """A note naming every checkpoint directory the classes loaded in the fake world (none: no note): not read,
    what the figures are then, and what of the load is left out (:mod:`paddle_hybrid.gloo.fake_checkpoint`)."""
    seen = {}
    for e in entries:
        for load in e.get("checkpoint_loads") or []:
            seen.setdefault(load["path"], load)
    if not seen:
        return []
    directories = "; ".join(f"{path} ({load['format']}, {load['files']} data file{'' if load['files'] == 1 else 's'}, "
                            f"{gib(load['file_bytes'])}, largest {gib(load['largest_file_bytes'])})"
                            for path, load in seen.items())
    return [f"checkpoints not read (a dry run reads no weights): {directories}. Each rank's tensors keep the shapes, "
            "dtypes and placements the script built (the model's configuration and the layout), which is what the "
            "figures measure. Left out: the load's own memory before step 1 (a real rank reads each file assigned to "
            "it whole, on the device unless offloaded, and slices it: each file read adds up to the largest named "
            "here) and whether the checkpoint's tensors match the configuration"]


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
