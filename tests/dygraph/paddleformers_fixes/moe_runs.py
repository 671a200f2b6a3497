"""What the MoE families' tests share: a tiny model written by ``examples/paddleformers_trainer.py``, a run
of the example through a test worker (one process or ``paddle_hybrid.launch``), and a rank's whole value of
a parameter."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_trainer import SCRIPT, _env


def tiny_model(work: str, family: str) -> str:
    """``write-tiny-model --family family`` into ``work`` (once)."""
    path = os.path.join(work, f"tiny-{family}")
    if not os.path.isdir(path):
        proc = subprocess.run([sys.executable, SCRIPT, "write-tiny-model", path, "--family", family], env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return path


def train(worker: str, out: str, model: str, nprocs: int, args) -> dict:
    """The example through ``worker train`` into ``out`` (cached: an existing ``out`` is read again):
    {"losses": {rank: {step: loss}}, "start"/"end": {rank: arrays}, "meta": {rank: ...}}."""
    if not os.path.isdir(out):
        argv = [worker, "train", SCRIPT, "--model_name_or_path", model, "--output_dir", out, *args]
        cmd = [sys.executable, *argv] if nprocs == 1 else [
            sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", str(nprocs), "--log_dir", out + ".log",
            *argv]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            logs = ""
            for f in sorted(os.listdir(out + ".log")) if os.path.isdir(out + ".log") else []:
                with open(os.path.join(out + ".log", f), errors="replace") as fh:
                    logs += f"\n--- {f}\n" + fh.read()[-2500:]
            pytest.fail(f"{os.path.basename(out)} exited with {proc.returncode}\n"
                        f"{(proc.stdout + proc.stderr)[-3000:]}{logs}")
    run = {"losses": {}, "start": {}, "end": {}, "meta": {}}
    for rank in range(nprocs):
        with open(os.path.join(out, f"progress.rank{rank}.json")) as f:
            run["losses"][rank] = {int(k): v for k, v in json.load(f)["loss"].items()}
        for label in ("start", "end"):
            with np.load(os.path.join(out, f"{label}.rank{rank}.npz")) as data:
                run[label][rank] = {k: data[k] for k in data.files}
        with open(os.path.join(out, f"meta.rank{rank}.json")) as f:
            run["meta"][rank] = json.load(f)
    return run


def whole(arrays: dict, name: str, reference):
    """This rank's whole value of ``name``: of the joined candidates (slices joined, or a fused
    projection's parts joined) the one closest to ``reference``."""
    candidates = [arrays[k] for k in (name, f"{name}::by_part") if k in arrays and arrays[k].shape == reference.shape]
    assert candidates, f"{name}: no value of shape {reference.shape}"
    return min(candidates, key=lambda a: np.abs(a - reference).max())
