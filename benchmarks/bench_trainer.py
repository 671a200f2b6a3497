"""PaddleFormers' Trainer on CPU (``examples/paddleformers_trainer.py``), side by side in one run:
tokens per second of each layout against one process, and the time from launch to the end of
the first step.

Each layout runs the example as a user does (``python -m paddle_hybrid.launch``, the CPU flags,
clipping on, gradient accumulation 2, the same global batch in every layout) for ``--steps``
steps on the example's tiny LLaMA.  Tokens per second counts the global batch's tokens of the
steps after the first, over the time between the first and the last step's end (rank 0's clock);
launch to first step is measured from just before the launcher starts to the end of step 1
(start-up, ``fleet.init``, loading the model through a flex checkpoint, the first step).

    python benchmarks/bench_trainer.py                    # one, TP2, PP2, DP2, sharding 2
    python benchmarks/bench_trainer.py --steps 30 --layouts one tp2
    python benchmarks/bench_trainer.py --local-ring-off     # beside each layout: gloo's TCP path
    python benchmarks/bench_trainer.py --local-p2p-off --layouts pp2   # p2p alone on gloo
    python benchmarks/bench_trainer.py --warm-start-off       # beside each layout: workers start cold
    python benchmarks/bench_trainer.py --size small           # a model where a step is arithmetic

``--local-ring-off`` adds, after each multi-process layout, the same run with
``PADDLE_HYBRID_LOCAL_RING=0 PADDLE_HYBRID_LOCAL_P2P=0`` (collectives and send/recv on gloo's TCP
pairs, as before the shared-memory paths); ``--local-p2p-off`` one with only
``PADDLE_HYBRID_LOCAL_P2P=0`` (send/recv on gloo, collectives through shared memory): the default
first, the others beside it, in one run.  ``--warm-start-off`` adds one with
``PADDLE_HYBRID_WARM_START=0`` (each worker imports Paddle after the launcher has: start-up as
before :mod:`paddle_hybrid.launch.warm_start`).

Prints a table and writes ``benchmarks/results/trainer.json``.  Needs PaddleFormers 1.2.0
(``PADDLE_HYBRID_EXTRAS=paddleformers source scripts/env.sh``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
EXAMPLE = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
CPU_FLAGS = ["--device", "cpu", "--bf16", "false", "--fp16", "false", "--amp_master_grad", "false",
             "--split_param", "false", "--report_to", "none"]
MICRO_BATCH, ACCUMULATE = 4, 2  # global batch: 8 sequences in every layout
SEQ = {"tiny": 16, "small": 64}  # tokens a sequence, by model size
LAYOUTS = {  # name: (processes, flags)
    "one": (1, []),
    "tp2": (2, ["--tensor_model_parallel_size", "2"]),
    "pp2": (2, ["--pipeline_model_parallel_size", "2"]),
    "dp2": (2, ["--per_device_train_batch_size", str(MICRO_BATCH // 2)]),
    "sharding2": (2, ["--sharding", "stage1", "--sharding_parallel_size", "2",
                      "--per_device_train_batch_size", str(MICRO_BATCH // 2)]),
}


def run_layout(work, model, name, steps, extra_env=None, seq=SEQ["tiny"]):
    nprocs, flags = LAYOUTS[name.split(" ")[0]]
    out = os.path.join(work, name.replace(" ", "_"))
    args = [EXAMPLE, "--model_name_or_path", model, "--output_dir", out, *CPU_FLAGS,
            "--max_steps", str(steps), "--gradient_accumulation_steps", str(ACCUMULATE), "--logging_steps", "1",
            "--per_device_train_batch_size", str(MICRO_BATCH), "--seq_length", str(seq), "--save_strategy", "no",
            *flags]
    cmd = [sys.executable, *args] if nprocs == 1 else [
        sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", str(nprocs), "--log_dir", out + ".log", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(extra_env or {}))
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(os.path.join(out, "progress.rank0.json")) as f:
        progress = json.load(f)
    ends = {int(k): v for k, v in progress["step_end_time"].items()}
    tokens = (steps - 1) * MICRO_BATCH * ACCUMULATE * seq
    return {"processes": nprocs, "steps": steps,
            "tokens_per_s": tokens / (ends[steps] - ends[1]),
            "launch_to_first_step_s": ends[1] - started,
            "final_loss": progress["loss"][str(steps)]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--local-ring-off", action="store_true",
                   help="also run each multi-process layout with PADDLE_HYBRID_LOCAL_RING=0 PADDLE_HYBRID_LOCAL_P2P=0")
    p.add_argument("--size", choices=sorted(SEQ), default="tiny",
                   help="the example's model: tiny (sequences of 16) or small (hidden 256, 4 layers, sequences of 64)")
    p.add_argument("--warm-start-off", action="store_true",
                   help="also run each multi-process layout with PADDLE_HYBRID_WARM_START=0")
    p.add_argument("--local-p2p-off", action="store_true",
                   help="also run each multi-process layout with PADDLE_HYBRID_LOCAL_P2P=0")
    args = p.parse_args(argv)
    if "one" not in args.layouts:
        args.layouts.insert(0, "one")
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        model = os.path.join(work, "tiny-llama")
        subprocess.run([sys.executable, EXAMPLE, "write-tiny-model", model, "--size", args.size], check=True,
                       capture_output=True)
        seq = SEQ[args.size]
        for name in args.layouts:
            rows[name] = run_layout(work, model, name, args.steps, seq=seq)
            if LAYOUTS[name][0] == 1:
                continue
            if args.warm_start_off:
                rows[f"{name} cold"] = run_layout(work, model, f"{name} cold", args.steps,
                                                  {"PADDLE_HYBRID_WARM_START": "0"}, seq=seq)
            if args.local_p2p_off:
                rows[f"{name} p2p-off"] = run_layout(work, model, f"{name} p2p-off", args.steps,
                                                     {"PADDLE_HYBRID_LOCAL_P2P": "0"}, seq=seq)
            if args.local_ring_off:
                rows[f"{name} ring-off"] = run_layout(work, model, f"{name} ring-off", args.steps,
                                                      {"PADDLE_HYBRID_LOCAL_RING": "0", "PADDLE_HYBRID_LOCAL_P2P": "0"},
                                                      seq=seq)
    base = rows["one"]["tokens_per_s"]
    print(f"{'layout':18s} {'procs':>5s} {'tokens/s':>10s} {'vs one':>7s} {'launch->step 1 (s)':>19s} {'loss':>8s}")
    for name, r in rows.items():
        r["vs_one_process"] = r["tokens_per_s"] / base
        print(f"{name:18s} {r['processes']:5d} {r['tokens_per_s']:10.0f} {r['vs_one_process']:6.2f}x "
              f"{r['launch_to_first_step_s']:19.1f} {r['final_loss']:8.4f}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "trainer.json" if args.size == "tiny" else f"trainer_{args.size}.json"), "w") as f:
        json.dump({"config": {"steps": args.steps, "local_ring_off_rows": args.local_ring_off,
                              "local_p2p_off_rows": args.local_p2p_off, "warm_start_off_rows": args.warm_start_off,
                              "micro_batch": MICRO_BATCH, "accumulate": ACCUMULATE, "seq_length": seq,
                              "model": f"examples/paddleformers_trainer.py --size {args.size}"},
                   "layouts": rows}, f, indent=1)


if __name__ == "__main__":
    main()
