"""``python -m paddle_hybrid.verify --layouts tp2,pp2 [--rtol R] [--atol A] [--grad-rtol G] SCRIPT [ARGS...]``
(see :mod:`paddle_hybrid.verify`)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from ..common.script_kind import trainer_flags
from . import DEFAULT_ATOL, DEFAULT_GRAD_RTOL, DEFAULT_RTOL, EXIT_DIFFERS, EXIT_EQUAL, EXIT_FAILED, run_layout
from . import compare as compare_mod
from . import nodes as nodes_mod
from . import shrink as shrink_mod
from .layouts import KINDS, LayoutError, for_kind, kind_of, layout_args, parse_layouts, script_flags


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paddle_hybrid.verify",
                                description="Train SCRIPT in one process and in each layout on CPU; say whether "
                                            "each layout gives one process's losses and parameters.")
    p.add_argument("--layouts", required=True,
                   help="comma-separated: tp2, pp2, pp4vp2, dp2, sharding2, sharding2s3, sp2, sep2, ep2, tp2pp2, ...")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative tolerance of losses and parameters")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute tolerance of losses and parameters")
    p.add_argument("--grad-rtol", type=float, default=DEFAULT_GRAD_RTOL,
                   help="tolerance of step 1's gradients, relative to each tensor's largest element; also what "
                        "each parameter element's rounding allowance is made for (see docs/verify.md)")
    p.add_argument("--kind", choices=("auto",) + KINDS, default="auto",
                   help="how the script takes a layout (auto: from its source; see docs/verify.md)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--work-dir", help="keep every run's records and logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the verdicts to this file")
    p.add_argument("--shrink-from", metavar="CONFIG",
                   help="a model's config.json: train a model shrunk from it that keeps, for the layouts, what each "
                        "rank of the real one holds (a Trainer script; see docs/verify.md)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="split each layout's ranks over this many launchers on this host, as nodes (docs/verify.md)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    try:
        layouts = parse_layouts(opts.layouts)
        with open(opts.script) as f:
            source = f.read()
        kind = kind_of(source) if opts.kind == "auto" else opts.kind
        flags = script_flags(source) if kind == "flags" else trainer_flags(source) if kind == "trainer" else None
        layouts = [for_kind(kind, layout) for layout in layouts]  # a Trainer's ep: over its TP ranks (layouts.py)
        for layout in [None, *layouts]:  # every layout's arguments made before any run: fail fast
            layout_args(kind, opts.args, layout, flags)
        nodes_mod.check(layouts, opts.nnodes)
        shrunk = shrink_mod.for_script(opts.shrink_from, kind, layouts, opts.args) if opts.shrink_from else None
    except (LayoutError, OSError, SyntaxError, ValueError) as exc:
        print(f"paddle_hybrid.verify: {exc}", file=sys.stderr)
        return EXIT_FAILED
    work = opts.work_dir or tempfile.mkdtemp(prefix="ph_verify_")
    print(f"paddle_hybrid.verify: {opts.script} ({kind} script), layouts {', '.join(l.name for l in layouts)}; "
          f"records in {work}" + (f"; each layout over {opts.nnodes} launchers (nodes)" if opts.nnodes > 1 else ""),
          flush=True)
    if shrunk is not None:
        script_args = shrink_mod.prepare(shrunk, opts.shrink_from, opts.args, os.path.join(work, "shrunk-model"),
                                         opts.timeout)
        if script_args is None:
            return EXIT_FAILED
        opts.args = script_args
    started = time.time()
    runs = [(None, "one")] + [(layout, layout.name) for layout in layouts]
    records, failures, seconds = {}, {}, {}
    for layout, name in runs:
        try:
            ok, took, tail = run_layout(opts.script, opts.args, layout, kind, flags, os.path.join(work, name),
                                        opts.timeout, opts.grad_rtol, nnodes=opts.nnodes)
        except LayoutError as exc:
            ok, took, tail = False, 0.0, str(exc)
        seconds[name] = took
        if ok:
            records[name] = compare_mod.load(os.path.join(work, name))
        else:
            failures[name] = tail
        print(f"  {name:<12} {'ran' if ok else 'FAILED'} in {took:.1f} s", flush=True)
    verdicts = {}
    if "one" in records:
        for layout in layouts:
            if layout.name in records:
                verdicts[layout.name] = compare_mod.compare(records["one"], records[layout.name], layout.degrees["mp"],
                                                            opts.rtol, opts.atol, opts.grad_rtol)
    _print_table(layouts, verdicts, failures, opts)
    status = EXIT_FAILED if failures else (EXIT_EQUAL if all(v.equal for v in verdicts.values()) else EXIT_DIFFERS)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"status": status, "seconds": seconds, "total_seconds": time.time() - started,
                       "failed": failures, "layouts": {name: {
                           "equal": v.equal, "first_step": v.first_step, "loss_diff": v.loss_diff,
                           "grad_diff": v.grad_diff, "grads_compared": v.grads_compared,
                           "param_diff": v.param_diff, "closest": v.closest, "largest": v.largest,
                           "findings": v.findings, "not_compared": v.not_compared,
                           "diverging": {k: [[n, d] for n, d in items[:10]] for k, items in v.diverging.items()}}
                           for name, v in verdicts.items()}}, f, indent=1)
    print(f"paddle_hybrid.verify: {time.time() - started:.0f} s in all", flush=True)
    if not opts.work_dir and not failures:
        shutil.rmtree(work, ignore_errors=True)
    return status


def _share(closest: dict, label: str) -> str:
    return "-" if label not in closest else f"{closest[label]['share']:.2g}"


def _print_table(layouts, verdicts, failures, opts) -> None:
    print(f"\n{'layout':<12} {'result':<10} {'first step':>10} {'loss diff':>10} {'grads step 1':>13} "
          f"{'params step 1':>14} {'params end':>11}")
    for layout in layouts:
        name = layout.name
        if name in failures or "one" in failures:
            print(f"{name:<12} {'FAILED':<10}")
            continue
        v = verdicts[name]
        print(f"{name:<12} {'equal' if v.equal else 'DIFFERS':<10} {v.first_step or '-':>10} {_fmt(v.loss_diff):>10} "
              f"{_fmt(v.grad_diff):>13} {_share(v.closest, 'step1'):>14} {_share(v.closest, 'end'):>11}")
    print(f"loss diff: relative (tolerance rtol {opts.rtol:g}, atol {opts.atol:g}); grads step 1: relative to the "
          f"tensor's largest gradient (tolerance {opts.grad_rtol:g});\nparams: the largest difference as a share of its "
          f"element's tolerance (atol + rtol |p| + its rounding allowance; above 1 differs)")
    for name, v in verdicts.items():
        print(f"\n{name}:")
        if v.not_compared:
            print(f"  - not compared: {', '.join(v.not_compared)} (a parameter never trained in this layout, a buffer "
                  "in one process)")
        if v.equal:
            print(f"  - equal within rounding: {_within(v, opts)}")
            continue
        for finding in v.findings:
            print(f"  - {finding}")
        items = v.diverging.get("grads", [])
        if items:
            print(f"  - gradients differ at step 1 (beyond {opts.grad_rtol:g} of the tensor's largest): "
                  f"{_names(items)}")
        for label in ("step1", "end"):
            items = v.diverging.get(label, [])
            if items:
                print(f"  - differ {'after step 1' if label == 'step1' else 'at the end'}: {_names(items)}")
    for name, tail in failures.items():
        print(f"\n{name} FAILED; the end of its log:\n{tail}")


def _names(items) -> str:
    shown = ", ".join(f"{n} ({_fmt(d) if d != float('inf') else 'shape'})" for n, d in items[:5])
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _within(v, opts) -> str:
    """What "equal" rests on: the largest differences against their tolerances."""
    text = f"losses {_fmt(v.loss_diff)} (tolerance {opts.rtol:g})"
    text += (f", step-1 gradients {_fmt(v.grad_diff)} (tolerance {opts.grad_rtol:g}, {v.grads_compared} parameters)"
             if v.grads_compared else ", no step-1 gradients recorded to compare")
    if not v.closest:
        return text
    text += f", parameters {max(c['share'] for c in v.closest.values()):.2g} of their tolerance"
    big = max(v.largest.values(), key=lambda c: c["diff"])
    text += f"; the largest parameter difference, {_fmt(big['diff'])} at {big['name']}{big['index']}"
    if big["allowance"] > big["tolerance"] - big["allowance"] and big["largest_gradient"]:
        # its tolerance is mostly its rounding allowance: say why it has one
        text += (f", is an element whose step-1 gradient is {_fmt(abs(big['gradient']) / big['largest_gradient'])} "
                 f"of its tensor's largest: rounding decides its update (tolerance {_fmt(big['tolerance'])})")
    return text


if __name__ == "__main__":
    sys.exit(main())
