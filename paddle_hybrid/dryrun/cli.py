"""The dry run's command line and its phases (see :mod:`paddle_hybrid.dryrun`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from ..common.script_kind import argument_defaults, kind_of, script_flags
from ..gloo import fake_contexts
from . import checks, classes, compose, gpu_estimate, gpu_step, report, runner

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_CONFIG, EXIT_FAILED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paddle_hybrid.dryrun",
        description="Step every rank class of an N x K job on this CPU, with fake collectives: per-rank memory, "
                    "communication and configuration errors before the GPU run.")
    p.add_argument("--nnodes", type=int, required=True, help="machines of the real job")
    p.add_argument("--nproc_per_node", type=int, required=True, help="ranks per machine of the real job")
    p.add_argument("--ranks", default="auto",
                   help="auto: one rank of every class; all: every rank; or a comma-separated list of ranks")
    p.add_argument("--json", default=None, help="write the report here as JSON")
    p.add_argument("--work", default=None, help="keep every rank's output and record here (default: a temporary "
                                                "directory, removed at the end)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank may wait on anything inside its process (PADDLE_HYBRID_TIMEOUT in it; "
                        "nothing should wait in a fake world)")
    p.add_argument("--wall-limit", type=float, default=3600.0, help="seconds one rank's process may run")
    p.add_argument("--measure-microbatches", type=int, default=None,
                   help="run each rank with this many microbatches a step instead of the script's, and compose the "
                        "activations the schedule keeps in flight with the script's own count (a model too large "
                        "to run its whole schedule here)")
    p.add_argument("--gpu-memory", type=float, default=None,
                   help="GB of the job's GPUs: the GPU estimate's share of it is printed (an estimate, see "
                        "docs/dryrun.md); default: --gpu's memory, else 80")
    p.add_argument("--gpu", default=None,
                   help="also price the job's step on this GPU (a100-80g, h100, h200): per stage and for the job, an "
                        "estimate (docs/plan.md)")
    p.add_argument("--inter-node-gbps", type=float, default=None,
                   help="with --gpu: the network's Gbit/s per GPU (default: the GPU's preset)")
    p.add_argument("--compose-layers", action="store_true",
                   help="measure each class with 1 and with 2 layers a pipeline chunk and compose every figure to the "
                        "script's own layers (a model too large to run whole here; see docs/dryrun.md)")
    p.add_argument("--png", default=None,
                   help="draw each class's memory on the GPU to this PNG; with --gpu also the step per stage "
                        "(<name>_step.png)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _chosen(spec: str, world_size: int):
    if spec in ("auto", "all"):
        return spec
    try:
        ranks = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise SystemExit(f"--ranks {spec!r}: auto, all, or ranks separated by commas (0,5,9)") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise SystemExit(f"--ranks {spec!r}: ranks from 0 to {world_size - 1}")
    return ranks


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu_memory is None:  # the named GPU's own size, else an 80 GB part
        try:
            args.gpu_memory = gpu_step.memory_gb(args.gpu) if args.gpu else 80.0
        except ValueError:
            args.gpu_memory = 80.0  # an unknown --gpu is refused with the other configuration errors
    world_size = args.nnodes * args.nproc_per_node
    if world_size < 1:
        raise SystemExit("--nnodes and --nproc_per_node must be at least 1")
    chosen = _chosen(args.ranks, world_size)
    script = os.path.abspath(args.script)
    with open(script) as f:
        source = f.read()
    kind = kind_of(source)
    started = time.time()

    # 1. checks (on the script's own arguments)
    flags = script_flags(source)
    defaults = argument_defaults(source, flags.values()) if flags else None
    degrees, errors = checks.check(kind, args.args, flags, world_size, args.nnodes, args.nproc_per_node, defaults)
    schedule_microbatches = checks.microbatches_of(kind, args.args, flags)
    run_args = list(args.args)
    if args.measure_microbatches is not None:
        run_args = checks.with_microbatches(kind, run_args, flags, args.measure_microbatches)
        if schedule_microbatches is None:
            raise SystemExit("--measure-microbatches composes with the script's own microbatches a step: give them on "
                             "its command line (gpt_pp.py: --accumulate-steps N)")
    one_chunk = args.measure_microbatches is not None and degrees["vp"] > 1
    base = {"world": world_size, "nnodes": args.nnodes, "nproc_per_node": args.nproc_per_node, "degrees": degrees,
            "schedule_microbatches": schedule_microbatches, "measured_microbatches": args.measure_microbatches,
            "schedule_virtual_stages": degrees["vp"], "measured_virtual_stages": 1 if one_chunk else degrees["vp"],
            "errors": [e.as_json() for e in errors], "rank_classes": [], "notes": _notes(one_chunk)}
    step_estimate = None
    if args.gpu and not errors:  # priced before any run: what cannot be priced is said at once
        try:
            base["gpu_step"], step_estimate, pricing = gpu_step.price(script, args.args, kind, degrees,
                                                                      schedule_microbatches, args.gpu, args.nnodes,
                                                                      args.nproc_per_node, args.gpu_memory,
                                                                      args.inter_node_gbps)
            step_estimate = (step_estimate, pricing)
        except (ValueError, OSError) as exc:
            errors.append(checks.ConfigError("--gpu", f"{exc}; drop --gpu to dry-run without the step's price"))
    if errors:
        base["errors"] = [e.as_json() for e in errors]
        for e in errors:
            print(f"configuration error: {e.field}: {e.message}", flush=True)
        _finish(args, base, started)
        return EXIT_CONFIG

    work = args.work or tempfile.mkdtemp(prefix="paddle_hybrid_dryrun_")
    os.makedirs(work, exist_ok=True)
    if one_chunk:  # the interleaved schedule cannot run one microbatch: measure the stage's layers as one chunk
        run_args = checks.with_one_chunk(kind, run_args, flags, work)

    def too_few(seen):  # the refusal of a run that ended before the measured step, in the user's own flags
        return checks.too_few_steps(kind, args.args, flags, defaults, seen)

    try:
        if args.compose_layers:
            return _run_composed(args, script, run_args, world_size, chosen, work, base, started, too_few,
                                 step_estimate, kind, flags, defaults, degrees)
        return _run_all(args, script, run_args, world_size, chosen, work, base, started, too_few, step_estimate)
    finally:
        if args.work is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def _run_rank(args, script, run_args, rank, world_size, work, label):
    _say(f"[paddle_hybrid.dryrun] {label}: running rank {rank} of {world_size}")
    return runner.run_rank(rank, world_size, args.nproc_per_node, script, run_args, work, args.timeout,
                           args.wall_limit, _say)


def _stands(rank_class) -> str:
    return f" (stands for ranks {classes.describe_ranks(rank_class.ranks)})" if rank_class else ""


def _steps_seen(run) -> int:
    return int((run.probe or {}).get("optimizer_steps", 0) or 0)


def _failed(run, label, rank_class=None) -> bool:
    if run.returncode == 0 and run.probe is not None:
        return False
    why = "stopped after --wall-limit" if run.timed_out else f"exit code {run.returncode}"
    if run.probe is not None and _steps_seen(run) < checks.MEASURED_STEP:
        seen = _steps_seen(run)
        why += f", after {seen} optimizer step{'' if seen == 1 else 's'} (step {checks.MEASURED_STEP} is measured)"
    print(f"the script failed in rank {run.rank}, {label}{_stands(rank_class)}: {why}\n--- its output, last lines:\n"
          f"{run.tail}", flush=True)
    return True


def _verdict(run, label, rank_class, too_few, base):
    """None: the rank's run ended well and measured its step 2.  Else its exit code, said: EXIT_FAILED for a
    script that failed (:func:`_failed`); EXIT_CONFIG for one that ended, exit 0, before the measured step
    (its probe saw fewer optimizer steps), with the flag and the value to give, in the report's errors too:
    its figures of step 2 would be zeros, and a report of them is wrong."""
    if _failed(run, label, rank_class):
        return EXIT_FAILED
    if run.probe.get("measured_step_completed") and _steps_seen(run) >= checks.MEASURED_STEP:
        return None
    field, message = too_few(_steps_seen(run))
    message = f"rank {run.rank}, {label}{_stands(rank_class)}: {message}"
    print(f"configuration error: {field}: {message}", flush=True)
    base["errors"].append({"field": field, "message": message, "rank": run.rank,
                           "class": rank_class.label if rank_class else None})
    return EXIT_CONFIG


# The fake world's words when a rank receives, before any step could go on, what a later stage sends it (an
# interleaved pipeline's first stage takes its second chunk's input from the last stage): run it again after.
WAITS_ON_A_LATER_STAGE = "whose run was not recorded before this one"


def _waits_on_a_later_stage(run) -> bool:
    return run.returncode != 0 and not run.timed_out and WAITS_ON_A_LATER_STAGE in run.tail and run.probe is not None


def _run_all(args, script, run_args, world_size, chosen, work, base, started, too_few, step_estimate=None,
             report_it=True) -> int:
    """``too_few(steps)``: (field, message) refusing a run that saw fewer optimizer steps than the measured one's
    number (:func:`~paddle_hybrid.dryrun.checks.too_few_steps`)."""
    # 2. rank 0, then the classes
    first = _run_rank(args, script, run_args, 0, world_size, work, "rank 0 (finds the topology)")
    if not _waits_on_a_later_stage(first) and _failed(first, "rank 0"):
        _finish(args, base, started)
        return EXIT_FAILED
    topology = first.probe.get("topology")
    if topology:  # fleet's own names and degrees, as it took them
        base["degrees"] = dict(topology["degrees"], virtual_pipeline=int(base["schedule_virtual_stages"]
                                                                         if base["measured_virtual_stages"] == 1
                                                                         else first.probe.get("virtual_stages", 1)))
    rank_classes = classes.classes_of(topology, world_size)
    stages = int(topology["degrees"].get("pipe", 1)) if topology else 1
    coords = classes.coordinates(topology["names"], topology["degrees"]) if topology else None
    if not _waits_on_a_later_stage(first):  # stopped before the measured step: said now, not after every class
        owner = next(c for c in rank_classes if 0 in c.ranks)
        code = _verdict(first, f"class {owner.label}", owner, too_few, base)
        if code is not None:
            _finish(args, base, started)
            return code

    # 3. one rank per class, in stage order; a rank that waited on a later stage once more at the end
    plan = _plan(rank_classes, chosen)
    runs, derived = {0: first}, {}
    for rank_class, rank in plan:
        label = f"class {rank_class.label}"
        source = _partition_source(rank_class, rank_classes, runs) if chosen == "auto" else None
        if source is not None:
            derived[rank] = source
            _say(f"[paddle_hybrid.dryrun] {label}: derived from rank {source[0]}'s run and its sharding partition")
            continue
        run = runs.get(rank) or _run_rank(args, script, run_args, rank, world_size, work, label)
        runs[rank] = run
        code = None if _waits_on_a_later_stage(run) else _verdict(run, label, rank_class, too_few, base)
        if code is not None:
            _finish(args, base, started)
            return code
    code = _rerun_the_waiting(args, script, run_args, world_size, work, plan, runs, too_few, base)
    if code is not None:
        _finish(args, base, started)
        return code

    # 4. receive shapes the fake world took from the other way, checked against the senders' runs
    if _shapes_contradicted(work):
        _finish(args, base, started)
        return EXIT_FAILED

    # 5. the report
    entries, by_rank = [], {}
    for rank_class, rank in plan:
        if rank in derived:
            source_rank, partition = derived[rank]
            entries.append(report.derived_entry(rank_class, by_rank[source_rank], partition, coords))
            continue
        covered = rank_class if chosen == "auto" else classes.RankClass(rank_class.key, [rank], rank)
        entries.append(report.class_entry(covered, runs[rank], stages, base["schedule_microbatches"],
                                          base["schedule_virtual_stages"], int(args.gpu_memory * 10**9)))
        by_rank[rank] = entries[-1]
    base["rank_classes"] = entries
    if chosen != "auto":
        run_ranks = {r for _, r in plan}
        base["not_run"] = [r for r in range(world_size) if r not in run_ranks]
    if report_it:
        _report(args, base, step_estimate, started)
    return EXIT_OK


def _report(args, base, step_estimate, started) -> None:
    """The table, the GPU step, the pictures and the JSON of a finished dry run.  ``step_estimate``: (the estimate
    from the model's shapes, its pricing), or None without ``--gpu``; the step is priced again from the kernels
    the runs recorded where they recorded any."""
    base["notes"].extend(report.checkpoint_notes(base["rank_classes"]))  # checkpoints not read (fake world)
    base["notes"].extend(report.expert_lines(base["rank_classes"]))  # each class's experts, forced-balanced routing
    print(report.table(base["rank_classes"]), flush=True)
    if step_estimate is not None:
        shapes_estimate, pricing = step_estimate
        step_estimate = shapes_estimate
        from_records = gpu_step.price_recorded(pricing, base["rank_classes"])
        if from_records is not None:
            base["gpu_step_from_shapes"] = base["gpu_step"]
            base["gpu_step"], step_estimate = from_records
    if "gpu_step" in base:
        print(gpu_step.table(base["gpu_step"]), flush=True)
        if "gpu_step_from_shapes" in base:
            print(f"  (from the model's shapes instead of the recorded kernels: "
                  f"{base['gpu_step_from_shapes']['step_time_s']:.3f} s)", flush=True)
    if args.png:
        _draw(args, base["rank_classes"], step_estimate)
    _finish(args, base, started)


def _run_composed(args, script, run_args, world_size, chosen, work, base, started, too_few, step_estimate, kind,
                  flags, defaults, degrees) -> int:
    """``--compose-layers``: the dry run with 1 and with 2 layers a pipeline chunk, every figure composed to the
    script's own layers a chunk (:mod:`.compose`)."""
    import copy

    chunks = degrees["pp"] * base["measured_virtual_stages"]
    total = checks.layers_of(kind, args.args, flags, defaults)
    per_chunk = compose.per_chunk_layers(total, chunks)
    measured = []
    for layers_a_chunk in (1, 2):
        sub = os.path.join(work, f"layers{layers_a_chunk}")
        os.makedirs(sub, exist_ok=True)
        run = copy.deepcopy(base)
        code = _run_all(args, script, checks.with_layers(kind, run_args, flags, sub, chunks * layers_a_chunk),
                        world_size, chosen, sub, run, started, too_few, report_it=False)
        if code != EXIT_OK:
            return code
        measured.append(run["rank_classes"])
    base.update({key: run[key] for key in ("degrees", "not_run") if key in run})  # fleet's own, as the runs took them
    base["rank_classes"] = compose.entries(measured[0], measured[1], per_chunk)
    for entry in base["rank_classes"]:  # the experts are counted, not composed: the run of 2 layers a chunk
        if entry.get("experts"):
            entry["experts"] = dict(entry["experts"], composed_from="not composed: the run with 2 layers a chunk")
    base["composed_from_layers"] = [chunks, 2 * chunks]
    base["notes"].append(compose.NOTE.format(one=chunks, two=2 * chunks, layers=total, per_chunk=per_chunk))
    _report(args, base, step_estimate, started)
    return EXIT_OK


def _draw(args, entries, step_estimate) -> None:
    from . import pictures

    if not pictures.memory_bars(entries, args.png):
        print("--png needs matplotlib (pip install matplotlib): nothing drawn", flush=True)
        return
    drawn = [args.png]
    if step_estimate is not None:
        step_path = os.path.splitext(args.png)[0] + "_step.png"
        gpu_step.draw(step_estimate, step_path)
        drawn.append(step_path)
    print(f"drew {' and '.join(drawn)}", flush=True)


MAX_ROUNDS = 8  # reruns of the ranks that waited; each round must record more than the one before


def _rerun_the_waiting(args, script, run_args, world_size, work, plan, runs, too_few, base):
    """Run again, in stage order, every rank that stopped waiting on a rank not yet recorded, until
    none waits.  Two stages can each wait on the other (an interleaved pipeline's first stage takes
    its second chunk's input from the last stage, which took its first from the first): each round
    lets each go further on what the other recorded in the round before.  A round that records
    nothing new cannot help the next: the wait is then the failure, named.  None: every run ended
    well; else the exit code (said: :func:`_verdict`)."""
    for round_number in range(1, MAX_ROUNDS + 1):
        waiting = [(c, r) for c, r in plan if r in runs and _waits_on_a_later_stage(runs[r])]
        if not waiting:
            return None
        recorded = _recorded_messages(work)
        for rank_class, rank in waiting:
            label = f"class {rank_class.label}"
            runs[rank] = _run_rank(args, script, run_args, rank, world_size, work,
                                   f"{label} (again, round {round_number}: the stages it receives from have run)")
            code = None if _waits_on_a_later_stage(runs[rank]) else _verdict(runs[rank], label, rank_class,
                                                                               too_few, base)
            if code is not None:
                return code
        if _recorded_messages(work) == recorded:
            break
    still = [(c, r) for c, r in plan if r in runs and _waits_on_a_later_stage(runs[r])]
    for rank_class, rank in still:
        _failed(runs[rank], f"class {rank_class.label} (still waiting after {round_number} rounds of reruns)",
                rank_class)
    return EXIT_FAILED if still else None


def _recorded_messages(work) -> int:
    """How many point-to-point messages the runs so far recorded (Python's and C++'s)."""
    folder, total = os.path.join(work, "records"), 0
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith(("sent.", "sent_cpp.")):
            with open(os.path.join(folder, name)) as f:
                records = json.load(f)
            total += sum(len(v) for v in records.values()) if isinstance(records, dict) else len(records)
    return total


def _shapes_contradicted(work) -> bool:
    """A rank whose dynamic-shape receive ran before its sender took the shape of its own send the
    other way (``fake_contexts.assumed``); now every run is recorded, each is checked against what the
    sender sent.  A difference is a wrong figure: said, and the dry run fails."""
    folder = os.path.join(work, "records")
    assumed, sent = [], []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            if name.startswith("assumed_cpp."):
                assumed.extend(json.load(f))
            elif name.startswith("sent_cpp."):
                sent.extend(json.load(f))
    wrong = fake_contexts.unconfirmed(assumed, sent)
    for mine, theirs in wrong:
        print(f"the fake world assumed message {mine['index']} on {mine['pair']} had dims {mine['dims']} (dtype "
              f"{mine['dtype']}), the shape of the send the other way; the sender's run sent {theirs['dims']} "
              f"(dtype {theirs['dtype']}). Dry-run with --ranks all and pipeline stages in order, or report this.",
              flush=True)
    return bool(wrong)


def _partition_source(rank_class, rank_classes, runs):
    """(rank, sharding partition) of the run a sharding rank's class is derived from: its stage's sharding rank 0,
    run and finished, whose probe recorded the partition; None: run this class itself."""
    if rank_class.key.get("sharding", 0) == 0:
        return None
    stage = rank_class.key.get("pipe")
    first = next((c for c in rank_classes if c.key.get("pipe") == stage and c.key.get("sharding", 0) == 0), None)
    run = runs.get(first.representative) if first is not None else None
    if run is None or run.returncode != 0 or not (run.probe or {}).get("sharding_partition"):
        return None
    return first.representative, run.probe["sharding_partition"]


def _plan(rank_classes, chosen):
    """[(class, rank to run)] in class order (pipeline stages ascending)."""
    if chosen == "auto":
        return [(c, c.representative) for c in rank_classes]
    wanted = range(max(max(c.ranks) for c in rank_classes) + 1) if chosen == "all" else chosen
    owner = {r: c for c in rank_classes for r in c.ranks}
    return sorted(((owner[r], r) for r in wanted), key=lambda cr: (rank_classes.index(cr[0]), cr[1]))


def _notes(one_chunk: bool) -> list:
    measured_as_one_chunk = [
        "virtual pipeline measured as one chunk a stage (--measure-microbatches: Paddle's interleaved schedule "
        "needs twice the stages in microbatches): the same layers a stage, so parameters, gradients, optimizer state "
        "and a microbatch's activations are the interleaved run's; in flight composed for the virtual stages; the "
        "pipeline's sends and receives are one chunk's (the interleaved schedule makes one pair a chunk boundary)"]
    return measured_as_one_chunk * one_chunk + [
        "values are the fake world's (paddle_hybrid.gloo.fake_world): shapes and dtypes are the real ones; an "
        "all_reduce leaves this rank's tensor, a receive from a rank recorded earlier gets what it sent",
        "measured: parameters, gradients, optimizer state, activations saved for backward and the allocator's peak "
        "in step 2, communication of step 2; composed: microbatches in flight (the schedule) and composed_peak_bytes",
        "a CPU's allocator: a GPU adds its caching allocator's fragmentation, workspaces and communication buffers",
        gpu_estimate.ASSUMPTIONS,
        "derived_from: a sharding rank's class derived from its stage's sharding rank 0 (run): the same parameters, "
        "gradients, activations and calls on its own groups, its own optimizer state from the partition that run's "
        "sharding optimizer made",
    ]


def _finish(args, result, started) -> None:
    result["wall_s"] = round(time.time() - started, 2)
    if args.json:
        report.write_json(args.json, result)
