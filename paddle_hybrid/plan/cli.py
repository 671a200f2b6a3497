"""``python -m paddle_hybrid.plan``: the command line (see :mod:`paddle_hybrid.plan`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..common.script_kind import argument_defaults, flag_value, kind_of
from . import hardware, tables as kernel_tables
from .estimate import FRAMEWORKS, estimate
from .layout import RECOMPUTE, enumerate_layouts, parse
from .model import PRESETS, from_config, from_gpt_pp_args

__all__ = ["main", "build_parser", "model_of_script", "best_of", "check_layout", "measured_error"]

EXIT_OK, EXIT_REFUSED = 0, 2
VALIDATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables", "validation.json")
GPU_JOB = ("priced as the GPU job: bf16 weights and activations with float32 main gradients, master weights and "
           "Adam moments; fused AdamW")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paddle_hybrid.plan",
        description="Rank the layouts of a training script on a GPU cluster by estimated step time (an estimate: "
                    "kernels priced from tables measured on GPUs, communication by placement, the pipeline "
                    "simulated; its measured error is printed).")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    p.add_argument("--gpu", required=True, help=f"the GPU: {', '.join(hardware.GPUS)}")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--layouts", default=None,
                   help="price exactly these (comma-separated, e.g. tp4pp8vp2dp4mb1rcsel; sp4: tp 4 with sequence "
                        "parallelism); a layout without mbN or rc takes the fastest that fits")
    p.add_argument("--model", default=None,
                   help=f"the model instead of the script's: a preset ({', '.join(PRESETS)}) or a config.json")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (overrides the script's / preset's)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="override the preset's 8")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="network Gbit/s per GPU (overrides the preset)")
    p.add_argument("--gpu-memory", type=float, default=None, help="GB a GPU holds (overrides the preset)")
    p.add_argument("--gpu-table", default=None, help="kernel tables measured by benchmarks/bench_gpu_tables.py")
    p.add_argument("--attention", default="script", choices=("script", "flash", "unfused"),
                   help="the attention kernel of the GPU job: as the script runs it (gpt_pp.py: its matmul + softmax, "
                        "unfused; a Trainer script or a LLaMA-style model: flash), or flash / unfused")
    p.add_argument("--framework", default="paddle", choices=sorted(FRAMEWORKS),
                   help="how the job runs its layout (paddle: fleet's order and overlaps)")
    p.add_argument("--top", type=int, default=15, help="rows of the table to print")
    p.add_argument("--dryrun-top", type=int, default=0, metavar="K",
                   help="dry-run the K fastest layouts that fit at their real size (python -m paddle_hybrid.dryrun "
                        "--gpu): the step priced from each run's recorded kernels and its measured memory beside the "
                        "plan's (a script that declares its layout flags: examples/gpt_pp.py)")
    p.add_argument("--json", default=None, help="write every priced layout here")
    p.add_argument("--png", default=None,
                   help="draw the layouts (step time against memory per GPU, ties marked) to this PNG, and the best "
                        "layout's simulated step beside it (<name>_step.png)")
    p.add_argument("script", nargs="?", default=None, help="the training script (its model is read from its arguments)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def model_of_script(script: str, args: list, seq=None):
    """The transformer a script trains, read from its arguments without running it; ValueError naming what
    is missing."""
    with open(script) as f:
        source = f.read()
    kind = kind_of(source)
    if kind == "flags":
        names = ("--hidden", "--heads", "--layers", "--seq-len", "--vocab", "--ffn", "--dropout")
        defaults = argument_defaults(source, names)
        values = {n[2:].replace("-", "_"): flag_value(args, n, defaults.get(n)) for n in names}
        if any(values[k] is None for k in ("hidden", "heads", "layers", "seq_len")):
            raise ValueError(f"{script}: the model's sizes are not literal defaults or arguments: give --model")
        model = from_gpt_pp_args(values)
    elif kind == "trainer":
        path = flag_value(args, "--model_name_or_path")
        config = os.path.join(path, "config.json") if path and os.path.isdir(path) else path
        if not config or not os.path.exists(config):
            raise ValueError(f"{script}: a Trainer script's model comes from --model_name_or_path's config.json; "
                             f"{path!r} has none: give it, or --model")
        given = flag_value(args, "--seq_length", flag_value(args, "--max_seq_length"))  # the example's, PaddleFormers'
        model = from_config(config, seq=int(given) if given else None)
    else:
        raise ValueError(f"{script}: a plain fleet script's model cannot be read from its arguments: give --model "
                         "(a preset or a config.json)")
    if seq:
        import dataclasses
        model = dataclasses.replace(model, seq=seq)
    return model


def check_layout(layout, model, gpus, global_batch):
    """Why ``layout`` cannot run ``model`` on ``gpus`` GPUs with ``global_batch``, or None."""
    if layout.gpus != gpus:
        return f"uses {layout.gpus} GPUs (tp x pp x dp x sharding), not --gpus {gpus}"
    for what, n in (("heads", model.heads), ("kv heads", model.kv_heads), ("FFN", model.ffn), ("vocabulary", model.vocab)):
        if n % layout.tp:
            return f"{what} {n} do not divide over tp {layout.tp}"
    if model.layers % (layout.pp * layout.vp):
        return f"{model.layers} layers do not divide over pp {layout.pp} x vp {layout.vp}"
    if global_batch % layout.replicas:
        return f"global batch {global_batch} does not divide over {layout.replicas} data-parallel replicas"
    if layout.mbs and (global_batch // layout.replicas) % layout.mbs:
        return f"micro-batch {layout.mbs} does not divide the {global_batch // layout.replicas} sequences a replica takes"
    return None


def best_of(model, layout, clus, tables, global_batch, fw):
    """The estimate of ``layout``; where it leaves mbs or recompute open, the fastest completion that fits (else the
    one using least memory)."""
    import dataclasses
    per_replica = global_batch // layout.replicas
    mbs_options = [layout.mbs] if layout.mbs else [m for m in (1, 2, 4, 8) if per_replica % m == 0]
    rc_options = [layout.recompute] if layout.recompute else list(RECOMPUTE)
    found = [estimate(model, dataclasses.replace(layout, mbs=m, recompute=r), clus, tables, global_batch, fw)
             for m in mbs_options for r in rc_options]
    fitting = [e for e in found if e.fits]
    return min(fitting, key=lambda e: e.step_time_s) if fitting else min(found, key=lambda e: e.peak_bytes_per_gpu)


def measured_error(clus):
    """The error measured on unseen runs most like this job: the multi-node set for a job beyond one node,
    the one-node set otherwise; None without a record."""
    try:
        with open(VALIDATION) as f:
            sets = json.load(f)["sets"]
    except (OSError, ValueError, KeyError):
        return None
    return sets.get("korthikanti" if clus.nodes > 1 else "vtrain")


def _gib(n):
    return f"{n / 2 ** 30:.1f}"


def _print_table(rows, top, tie, out=None):
    out = out or sys.stdout
    best = next((r for r in rows if r.fits), None)
    print(f"{'#':>3} {'layout':<28} {'step s':>8} {'GiB/GPU':>8} {'fits':>4} {'MFU':>6} {'tokens/s':>10}  dominated by",
          file=out)
    for i, e in enumerate(rows[:top], 1):
        parts = e.breakdown
        dominant = max(parts, key=parts.get).replace("_s", "").replace("_", " ")
        mark = "tie" if best is not None and e is not best and e.fits and tie and \
            e.step_time_s <= best.step_time_s * (1 + tie) else ""
        print(f"{i:>3} {e.layout.name():<28} {e.step_time_s:>8.3f} {_gib(e.peak_bytes_per_gpu):>8} "
              f"{'yes' if e.fits else 'NO':>4} {e.mfu * 100:>5.1f}% {e.tokens_per_s:>10.0f}  {dominant} {mark}", file=out)


def _confirm(args, priced, clus, model):
    """``--dryrun-top``: the rows it prints, or None (refused, said)."""
    from . import confirm

    if not args.script:
        print("plan: --dryrun-top dry-runs the script: give it (with its arguments), not --model", file=sys.stderr)
        return None
    try:
        rows = confirm.confirm(priced, args.dryrun_top, args.script, args.args, clus, args.global_batch, model.layers)
    except ValueError as exc:
        print(f"plan: --dryrun-top: {exc}", file=sys.stderr)
        return None
    print(f"dry-run at real size, the top {len(rows)}:")
    for row in rows:
        if row["exit"] != 0:
            print(f"  {row['layout']:<28} the dry run failed (exit {row['exit']}): see its output above")
            continue
        print(f"  {row['layout']:<28} step: plan {row['plan_step_s']:.3f} s, from the run's kernels "
              f"{row['dryrun_step_s']:.3f} s; memory allocated a GPU: plan {_gib(row['plan_allocated_bytes'])} GiB, "
              f"the run's GPU estimate {_gib(row['dryrun_gpu_estimate_bytes'])} GiB")
    return rows


def _lean(e):
    """The estimate without its simulated timeline: a plan holds thousands (the best is simulated again to draw)."""
    e.timeline = None
    return e


def _draw(path, priced, clus, tie, model, again):
    from . import pictures

    title = f"{model.name} on {clus.gpus} x {clus.gpu.name}: an estimate"
    if not pictures.layouts_scatter(priced, path, clus.memory_bytes, tie, title):
        print("plan: --png needs matplotlib (pip install matplotlib); nothing drawn", file=sys.stderr)
        return
    best = next((e for e in priced if e.fits), priced[0])
    step_path = os.path.splitext(path)[0] + "_step.png"
    pictures.step_timeline(again(best), step_path)
    print(f"drew {path} and {step_path}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    # 1. the cluster and its tables
    try:
        gpu = hardware.gpu_named(args.gpu)
        clus = hardware.cluster(gpu, args.gpus, args.gpus_per_node, args.inter_node_gbps, args.gpu_memory)
        tables = kernel_tables.load(gpu, args.gpu_table)
    except (ValueError, FileNotFoundError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    # 2. the model
    try:
        if args.model:
            model = PRESETS[args.model] if args.model in PRESETS else from_config(args.model, seq=args.seq_len)
        elif args.script:
            model = model_of_script(args.script, args.args, args.seq_len)
        else:
            raise ValueError("give the training script (and its arguments) or --model")
        if args.seq_len and args.model in PRESETS:
            import dataclasses
            model = dataclasses.replace(model, seq=args.seq_len)
        if args.attention != "script":
            import dataclasses
            model = dataclasses.replace(model, attention=args.attention)
    except (ValueError, OSError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    # 3. the layouts
    fw = FRAMEWORKS[args.framework]
    if args.layouts:
        layouts = []
        for text in args.layouts.split(","):
            try:
                layout = parse(text.strip())
            except ValueError as exc:
                print(f"plan: {exc}", file=sys.stderr)
                return EXIT_REFUSED
            why = check_layout(layout, model, args.gpus, args.global_batch)
            if why:
                print(f"plan: layout {text.strip()}: {why}", file=sys.stderr)
                return EXIT_REFUSED
            layouts.append(layout)
        priced = [_lean(best_of(model, layout, clus, tables, args.global_batch, fw)) for layout in layouts]
    else:
        layouts = enumerate_layouts(model, args.gpus, args.global_batch, clus.gpus_per_node)
        if not layouts:
            print(f"plan: no layout of {args.gpus} GPUs divides this model and a global batch of {args.global_batch}",
                  file=sys.stderr)
            return EXIT_REFUSED
        priced = [_lean(estimate(model, layout, clus, tables, args.global_batch, fw, simulate_unfit=False))
                  for layout in layouts]
    # 4. rank and report
    priced.sort(key=lambda e: (not e.fits, e.step_time_s))
    error = measured_error(clus)
    tie = error["mean_abs_error"] if error else None
    print(f"{model.name}: {model.params / 1e9:.2f} B parameters, seq {model.seq}, global batch {args.global_batch}, "
          f"{args.gpus} x {gpu.name} ({clus.gpus_per_node} a node, {clus.memory_bytes / 1e9:.0f} GB), {fw.name}'s "
          f"overlaps and rank order; {GPU_JOB}; {model.attention} attention")
    print(f"an ESTIMATE: {len(priced)} layouts priced, {sum(e.fits for e in priced)} fit; "
          + (f"its error on {error['runs']} measured runs it was not fitted to, {error['what']}: mean "
             f"{error['mean_abs_error'] * 100:.1f} %, worst {error['worst_abs_error'] * 100:.1f} %; layouts within "
             "the mean error of the best are marked tie" if error else
             "no measured error on record (benchmarks/bench_plan.py --fit --write-validation writes it)"))
    for note in sorted({n for e in priced for n in e.notes}):
        print(f"note: {note}")
    _print_table(priced, args.top, tie)
    if args.dryrun_top:
        confirmed = _confirm(args, priced, clus, model)
        if confirmed is None:
            return EXIT_REFUSED
    if args.png:
        _draw(args.png, priced, clus, tie, model, lambda e: estimate(model, e.layout, clus, tables, args.global_batch, fw))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model.name, "gpus": args.gpus, "gpu": gpu.name, "global_batch": args.global_batch,
                       "estimate_error": error, "layouts": [e.as_json() for e in priced]}, f, indent=1)
    print(f"({time.time() - started:.1f} s)", file=sys.stderr)
    return EXIT_OK
