"""``python -m paddle_hybrid.verify``: prove a training script's layouts against one process, on CPU.

    python -m paddle_hybrid.verify --layouts tp2,pp2,dp2,sharding2 [--rtol R] [--atol A] SCRIPT [ARGS...]

Runs SCRIPT, unchanged, in one process and in each layout (over gloo, through
:mod:`paddle_hybrid.launch`), each recording every step's loss and every parameter, whole and under
its one-process name, after step 1 and at the end (:mod:`paddle_hybrid.dygraph.verify_record`);
then compares each layout with one process (:mod:`.compare`) and prints a table: layout, equal or
the first diverging step, the largest differences; and for a layout that differs, what it saw.
How a script takes a layout, and how every layout starts from the same weights:
:mod:`.layouts`.

Exit status: 0 every layout equals one process; 1 a layout differs; 2 a run failed (its log's
tail is printed).  How it works and what each finding means: ``docs/verify.md``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .layouts import Layout, LayoutError, for_kind, layout_args

__all__ = ["main", "run_layout", "LayoutError"]

DEFAULT_RTOL, DEFAULT_ATOL = 1e-5, 1e-6
# step 1's gradients: the largest difference of a tensor's, relative to its largest element (see
# compare.py and docs/verify.md: healthy layouts measured within 9.4e-7, the smallest defect 3.8e-2)
DEFAULT_GRAD_RTOL = 1e-5
EXIT_EQUAL, EXIT_DIFFERS, EXIT_FAILED = 0, 1, 2


def _bootstrap() -> str:
    from ..launch import BOOTSTRAP

    return BOOTSTRAP


def _with_output_dir(kind: str, args: list, directory: str) -> list:
    """A Trainer script writes into the run's own directory (layouts must not share one)."""
    if kind != "trainer":
        return args
    out = list(args)
    for i, a in enumerate(out):
        if a == "--output_dir" and i + 1 < len(out):
            out[i + 1] = os.path.join(directory, "output")
            return out
        if a.startswith("--output_dir="):
            out[i] = "--output_dir=" + os.path.join(directory, "output")
            return out
    return out + ["--output_dir", os.path.join(directory, "output")]


def run_layout(script: str, args: list, layout: Layout | None, kind: str, flags: dict | None, directory: str,
               timeout: float, gradient_rtol: float = DEFAULT_GRAD_RTOL, nnodes: int = 1) -> tuple[bool, float, str]:
    """Run ``script`` in ``layout`` (None: one process) recording into ``directory``, the layout's
    ranks over ``nnodes`` launchers (:mod:`.nodes`); ``(ok, seconds, log tail)``.  The one-process
    run also records each parameter element's rounding allowance for ``gradient_rtol`` (:class:`~paddle_hybrid.dygraph.verify_record.RoundingAllowance`)."""
    os.makedirs(directory, exist_ok=True)
    layout = for_kind(kind, layout)  # a Trainer's ep: over its tensor-parallel ranks (layouts.for_kind)
    name = layout.name if layout else "one"
    plan = {"layout": name, "degrees": layout.degrees if layout else {}, "set_degrees": kind == "fleet",
            "seeded_init": kind == "fleet", "reference": layout is None, "gradient_rtol": gradient_rtol}
    with open(os.path.join(directory, "plan.json"), "w") as f:
        json.dump(plan, f)
    script_args = _with_output_dir(kind, layout_args(kind, args, layout, flags), directory)
    env = dict(os.environ, PADDLE_HYBRID_VERIFY_DIR=directory)
    env.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if layout is None:
        cmd = [sys.executable, _bootstrap(), script, *script_args]
    else:
        cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", str(layout.nprocs), "--log_dir",
               os.path.join(directory, "logs"), script, *script_args]
    start = time.time()
    if layout is not None and nnodes > 1:
        from . import nodes

        cmd = [f"{nnodes} launchers (node I: python -m paddle_hybrid.launch --nnodes {nnodes} --rank I ...)"]
        ok, out = nodes.run(script, script_args, layout.nprocs, nnodes, directory, env, timeout)
    else:
        ok, out = _run(cmd, env, timeout)
    with open(os.path.join(directory, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + out)
    return ok, time.time() - start, _tail(out, directory)


def _run(cmd: list, env: dict, timeout: float) -> tuple[bool, str]:
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        ok, out = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        ok, out = False, f"did not finish within {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return ok, out


def _tail(out: str, directory: str) -> str:
    logs = os.path.join(directory, "logs")
    text = out[-1500:]
    if os.path.isdir(logs):
        for name in sorted(os.listdir(logs)):
            if name.startswith("workerlog"):
                with open(os.path.join(logs, name), errors="replace") as f:
                    body = f.read()
                if "Error" in body or "Traceback" in body:
                    text += f"\n--- {name}\n" + body[-1500:]
                    break
    return text
