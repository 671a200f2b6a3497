"""``python -m paddle_hybrid.dryrun`` at real size, and its own cost.

Cases (``--case``, several allowed; default ``cost``):

* ``llama8b-128``: LLaMA-3-8B's configuration (hidden 4096, 32 layers, 32 heads, 8 kv heads, FFN 14336,
  vocabulary 128256; random weights from the configuration, nothing downloaded) through PaddleFormers'
  Trainer (``examples/paddleformers_trainer.py --init_from_config``), sequence ``--seq`` (4096),
  micro-batch 1, 8 microbatches a step, at tp8 x pp4 on 16 x 8 = 128 ranks (PaddleFormers gives the
  remaining 4 to sharding stage 1).  Each rank runs one microbatch a step
  (``--measure-microbatches 1``) and the schedule's in-flight count is composed.  ``--ranks``: which
  ranks to run (default ``auto``: each stage's sharding rank 0 runs, its other sharding ranks are derived
  from that run and the partition its sharding optimizer made).
* ``llama8b-1024``: the same model at tp8 x pp8 x vp2 on 128 x 8 = 1024 ranks, 16 microbatches a step (the
  interleaved schedule's least: twice the stages); the virtual pipeline is the model configuration's
  ``virtual_pipeline_model_parallel_size`` (PaddleFormers 1.2's TrainingArguments has no flag for it); the
  remaining 16 ranks go to sharding stage 1.  With one microbatch measured, each stage runs its layers as
  one chunk (the interleaved schedule cannot run one microbatch) and in flight is composed for two.
* ``gpt175b-compose``: GPT-3 175B's shapes (hidden 12288, 96 heads, 96 layers, FFN 49152, vocabulary 51200,
  sequence 2048) through ``examples/gpt_pp.py`` at tp8 x pp2 on 2 x 8 = 16 ranks, 2 microbatches of 1 a step:
  every class measured with 1 and 2 layers a stage and composed to its 48 (``--compose-layers``), and the step
  priced on 16 A100s from the runs' recorded kernels (``--gpu a100-80g``): a model that cannot run whole here,
  at its real per-rank shapes.
* ``static-128``: a static program at 128 ranks: ``examples/static_mlp.py`` (``dist.to_static``: 8 blocks of
  hidden 2048, AdamW) at pp4 x dp4 x mp8 on 16 x 8 ranks, sharding stage 1 over dp, 1F1B over 4 microbatches:
  one run per stage and sharding rank (16 classes), each against the whole job's mesh.
* ``cost``: the dry run's time per rank class against the same rank's step in a real run, at a size where
  both run (``examples/gpt_pp.py`` pp2, hidden 512, 2 processes on 2 cores): step 2's seconds in each.

Prints a table, writes ``--out`` (JSON): per case, per rank run, wall seconds, peak resident bytes of its
process, and the report's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "float32"}
CPU = ["--device", "cpu", "--bf16", "false", "--fp16", "false", "--amp_master_grad", "false", "--split_param", "false",
       "--report_to", "none"]
# (nnodes, nproc, tp, pp, vp, microbatches a step)
LAYOUTS = {"llama8b-128": (16, 8, 8, 4, 1, 8), "llama8b-1024": (128, 8, 8, 8, 2, 16)}


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _dry_run(cmd: list, report: str) -> dict:
    """Run the dry run's command; its JSON report, with the benchmark's wall time and the exit status."""
    start = time.time()
    proc = subprocess.run(cmd, env=_env(), text=True, capture_output=True)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    with open(report) as f:
        result = json.load(f)
    result["bench_wall_s"] = round(time.time() - start, 1)
    result["returncode"] = proc.returncode
    return result


def llama(case: str, work: str, seq: int, ranks: str | None) -> dict:
    nnodes, nproc, tp, pp, vp, microbatches = LAYOUTS[case]
    model = os.path.join(work, f"llama-3-8b-config-vp{vp}")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(dict(LLAMA_3_8B, virtual_pipeline_model_parallel_size=vp), f)
    report = os.path.join(work, f"{case}.json")
    cmd = [sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
           "--ranks", ranks or "auto", "--measure-microbatches", "1", "--work", os.path.join(work, case),
           "--json", report, TRAINER, "--model_name_or_path", model, "--init_from_config", "true", "--output_dir",
           os.path.join(work, f"{case}-out"), *CPU, "--max_steps", "2", "--gradient_accumulation_steps", str(microbatches),
           "--per_device_train_batch_size", "1", "--seq_length", str(seq), "--num_samples", "64", "--save_strategy",
           "no", "--logging_steps", "1", "--tensor_model_parallel_size", str(tp), "--pipeline_model_parallel_size",
           str(pp)]
    return _dry_run(cmd, report)


def gpt175b(work: str) -> dict:
    report = os.path.join(work, "gpt175b-compose.json")
    cmd = [sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "2", "--nproc_per_node", "8", "--compose-layers",
           "--gpu", "a100-80g", "--work", os.path.join(work, "gpt175b"), "--json", report, GPT, "--mp", "8", "--pp",
           "2", "--hidden", "12288", "--heads", "96", "--layers", "96", "--ffn", "49152", "--vocab", "51200",
           "--seq-len", "2048", "--micro-batch-size", "1", "--accumulate-steps", "2", "--steps", "2",
           "--out-dir", os.path.join(work, "gpt175b-out")]
    return _dry_run(cmd, report)


def static128(work: str) -> dict:
    report = os.path.join(work, "static-128.json")
    cmd = [sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "16", "--nproc_per_node", "8", "--work",
           os.path.join(work, "static-128"), "--json", report, os.path.join(ROOT, "examples", "static_mlp.py"), "--pp",
           "4", "--dp", "4", "--mp", "8", "--sharding-stage", "1", "--layers", "8", "--hidden", "2048",
           "--batch-size", "64", "--accumulate-steps", "4", "--steps", "3"]
    return _dry_run(cmd, report)


def cost(work: str) -> dict:
    """Step 2 of rank 0 (stage 0) and rank 1 (stage 1): in a real 2-process run, and in the dry run."""
    args = ["--pp", "2", "--steps", "2", "--layers", "4", "--hidden", "512", "--heads", "8", "--seq-len", "256",
            "--micro-batch-size", "4", "--accumulate-steps", "4", "--out-dir", os.path.join(work, "gpt-out")]
    real_probe = os.path.join(work, "cost-real")
    env = _env()
    env.update(PADDLE_HYBRID_DRYRUN_PROBE=real_probe)
    subprocess.run([sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "--log_dir",
                    os.path.join(work, "cost-real-log"), GPT, *args], env=env, check=True, capture_output=True)
    dry = os.path.join(work, "cost-dry")
    subprocess.run([sys.executable, "-m", "paddle_hybrid.dryrun", "--nnodes", "1", "--nproc_per_node", "2", "--work",
                    dry, "--json", os.path.join(work, "cost-dry.json"), GPT, *args], env=_env(), check=True,
                   capture_output=True)
    rows = []
    for rank in (0, 1):
        with open(os.path.join(real_probe, f"probe.{rank}.json")) as f:
            real = json.load(f)
        with open(os.path.join(dry, "probes", f"probe.{rank}.json")) as f:
            fake = json.load(f)
        rows.append({"rank": rank, "real_step_2_s": round(real["step_2_seconds"], 3),
                     "dry_step_2_s": round(fake["step_2_seconds"], 3),
                     "ratio": round(fake["step_2_seconds"] / real["step_2_seconds"], 3)})
    return {"rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=["cost", "gpt175b-compose", "static-128", *LAYOUTS], help="default: cost")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--ranks", default=None, help="ranks to run (the dry run's --ranks)")
    p.add_argument("--out", default="runs/bench_dryrun.json")
    p.add_argument("--work", default=None)
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench_dryrun_")
    results = {}
    for case in args.case or ["cost"]:
        results[case] = cost(work) if case == "cost" else gpt175b(work) if case == "gpt175b-compose" else \
            static128(work) if case == "static-128" else llama(case, work, args.seq, args.ranks)
    print("\ncase            rank/class          wall s   peak RSS GiB   peak alloc GiB   composed GiB   GPU est. GiB")
    for case, result in results.items():
        if case == "cost":
            for row in result["rows"]:
                print(f"{case:15} rank {row['rank']:<14} real step 2 {row['real_step_2_s']} s, dry {row['dry_step_2_s']} s"
                      f" ({row['ratio']}x)")
            continue
        for c in result.get("rank_classes", []):
            if c.get("derived_from") is not None:
                continue  # a sharding rank's class derived from its stage's run: no run of its own
            print(f"{case:15} {c['class'] + ' r' + str(c['representative']):19} {c['wall_s']:7.1f}   "
                  f"{c['max_rss_bytes'] / 2**30:12.2f}   {c['peak_bytes'] / 2**30:14.2f}   "
                  f"{c['composed_peak_bytes'] / 2**30:12.2f}   {c['gpu_estimate']['composed_peak_bytes'] / 2**30:12.2f}")
        derived = sum(1 for c in result.get("rank_classes", []) if c.get("derived_from") is not None)
        print(f"{case:15} {derived} more classes derived from these runs; wall {result.get('bench_wall_s')} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    failed = [case for case, result in results.items() if result.get("returncode")]
    if failed:  # a report without its classes is no figure
        print(f"FAILED: the dry run of {', '.join(failed)} exited non-zero (its output above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
