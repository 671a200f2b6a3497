"""``python -m paddle_hybrid.verify --layouts tp2,pp2 [--rtol R] [--atol A] SCRIPT [ARGS...]``
(see :mod:`paddle_hybrid.verify`)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from . import DEFAULT_ATOL, DEFAULT_RTOL, EXIT_DIFFERS, EXIT_EQUAL, EXIT_FAILED, run_layout
from . import compare as compare_mod
from .layouts import KINDS, LayoutError, kind_of, layout_args, parse_layouts, script_flags


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paddle_hybrid.verify",
                                description="Train SCRIPT in one process and in each layout on CPU; say whether "
                                            "each layout gives one process's losses and parameters.")
    p.add_argument("--layouts", required=True, help="comma-separated: tp2, pp2, dp2, sharding2, sp2, tp2pp2, ...")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative tolerance of losses and parameters")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute tolerance of losses and parameters")
    p.add_argument("--kind", choices=("auto",) + KINDS, default="auto",
                   help="how the script takes a layout (auto: from its source; see docs/verify.md)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--work-dir", help="keep every run's records and logs here (default: a temporary directory)")
    p.add_argument("--json", help="also write the verdicts to this file")
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
        flags = script_flags(source) if kind == "flags" else None
        for layout in [None, *layouts]:  # every layout's arguments made before any run: fail fast
            layout_args(kind, opts.args, layout, flags)
    except (LayoutError, OSError, SyntaxError, ValueError) as exc:
        print(f"paddle_hybrid.verify: {exc}", file=sys.stderr)
        return EXIT_FAILED
    work = opts.work_dir or tempfile.mkdtemp(prefix="ph_verify_")
    print(f"paddle_hybrid.verify: {opts.script} ({kind} script), layouts {', '.join(l.name for l in layouts)}; "
          f"records in {work}", flush=True)
    started = time.time()
    runs = [(None, "one")] + [(layout, layout.name) for layout in layouts]
    records, failures, seconds = {}, {}, {}
    for layout, name in runs:
        try:
            ok, took, tail = run_layout(opts.script, opts.args, layout, kind, flags, os.path.join(work, name),
                                        opts.timeout)
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
                                                            opts.rtol, opts.atol)
    _print_table(layouts, verdicts, failures, opts)
    status = EXIT_FAILED if failures else (EXIT_EQUAL if all(v.equal for v in verdicts.values()) else EXIT_DIFFERS)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"status": status, "seconds": seconds, "total_seconds": time.time() - started,
                       "failed": failures, "layouts": {name: {
                           "equal": v.equal, "first_step": v.first_step, "loss_diff": v.loss_diff,
                           "param_diff": v.param_diff, "findings": v.findings,
                           "diverging": {k: [[n, d] for n, d in items[:10]] for k, items in v.diverging.items()}}
                           for name, v in verdicts.items()}}, f, indent=1)
    print(f"paddle_hybrid.verify: {time.time() - started:.0f} s in all", flush=True)
    if not opts.work_dir and not failures:
        shutil.rmtree(work, ignore_errors=True)
    return status


def _print_table(layouts, verdicts, failures, opts) -> None:
    print(f"\n{'layout':<12} {'result':<10} {'first step':>10} {'loss diff':>10} {'params step 1':>14} "
          f"{'params end':>11}   (rtol {opts.rtol:g}, atol {opts.atol:g})")
    for layout in layouts:
        name = layout.name
        if name in failures or "one" in failures:
            print(f"{name:<12} {'FAILED':<10}")
            continue
        v = verdicts[name]
        print(f"{name:<12} {'equal' if v.equal else 'DIFFERS':<10} {v.first_step or '-':>10} {_fmt(v.loss_diff):>10} "
              f"{_fmt(v.param_diff.get('step1')):>14} {_fmt(v.param_diff.get('end')):>11}")
    for name, v in verdicts.items():
        if v.equal:
            continue
        print(f"\n{name}:")
        for finding in v.findings:
            print(f"  - {finding}")
        for label in ("step1", "end"):
            items = v.diverging.get(label, [])
            if items:
                shown = ", ".join(f"{n} ({_fmt(d) if d != float('inf') else 'shape'})" for n, d in items[:5])
                more = f" and {len(items) - 5} more" if len(items) > 5 else ""
                print(f"  - differ {'after step 1' if label == 'step1' else 'at the end'}: {shown}{more}")
    for name, tail in failures.items():
        print(f"\n{name} FAILED; the end of its log:\n{tail}")


if __name__ == "__main__":
    sys.exit(main())
