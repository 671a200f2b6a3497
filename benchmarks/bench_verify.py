"""``python -m paddle_hybrid.verify`` and the replica check, measured on 2 cores.

* **verify**: the whole command on ``examples/paddleformers_trainer.py`` (tiny LLaMA, 4 steps,
  accumulation 2, clipping 1.0) over one process, TP2, PP2, DP2 and sharding 2: wall time of the
  command and of each run (target: under 2 minutes).
* **replica check**: ``examples/gpt_pp.py`` (4 blocks, hidden 128, the default model) in DP2 and
  TP2, 12 steps, with ``PADDLE_HYBRID_CHECK_REPLICAS`` 0 (the default) and 1 (a check every step),
  side by side: the median step time of each (the first step left out) and what one check costs.

* **at the job's degrees** (``--case sixteen``): the whole verify command at 16 ranks on this machine,
  each with its wall time and the peak memory of all its processes together (resident bytes of the
  command's process tree, sampled every 0.2 s), and where the time goes (each run's wall time, which
  includes its processes' start-up; the comparison is the rest):

  - ``llama8b-tp4pp2dp2``: a LLaMA shrunk from LLaMA-3-8B's configuration (``--shrink-from``) through
    ``examples/paddleformers_trainer.py`` at tp4 x pp2 x dp2;
  - ``llama8b-tp2pp4vp2dp2``: the same at tp2 x pp4 x vp2 x dp2;
  - ``gpt-tp2pp2dp2-nnodes2``: ``examples/gpt_pp.py`` at tp2 x pp2 x dp2 over 2 launchers (``--nnodes 2``; 8 ranks).

  Targets (issue 46): under 5 minutes and 12 GiB each.

Prints a table and writes ``benchmarks/results/verify.json`` (``--out``).

    python benchmarks/bench_verify.py                     # verify and the replica check
    python benchmarks/bench_verify.py --case sixteen
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
TRAINER = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(cmd, env, timeout=1800):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} ... failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def measure_verify(work: str) -> dict:
    model = os.path.join(work, "tiny-llama")
    _run([sys.executable, TRAINER, "write-tiny-model", model], _env())
    verdict = os.path.join(work, "verdict.json")
    start = time.time()
    _run([sys.executable, "-m", "paddle_hybrid.verify", "--layouts", "tp2,pp2,dp2,sharding2", "--json", verdict,
          TRAINER, "--model_name_or_path", model, "--output_dir", "unused", "--device", "cpu", "--bf16", "false",
          "--fp16", "false", "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none",
          "--max_steps", "4", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
          "--max_grad_norm", "1.0", "--save_strategy", "no"], _env())
    total = time.time() - start
    with open(verdict) as f:
        result = json.load(f)
    return {"seconds": total, "runs": result["seconds"], "equal": {k: v["equal"] for k, v in result["layouts"].items()}}


def _gpt_step_time(work: str, name: str, layout: list, steps: int, check: int) -> float:
    out = os.path.join(work, name)
    _run([sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "--log_dir", out + ".log", GPT,
          *layout, "--steps", str(steps), "--out-dir", out, "--log-every", str(steps)],
         _env(PADDLE_HYBRID_CHECK_REPLICAS=check))
    [path] = glob.glob(os.path.join(out, "*.json"))
    with open(path) as f:
        times = json.load(f)["step_times"][1:]
    return statistics.median(times)


def measure_replica_check(work: str, steps: int) -> dict:
    rows = {}
    for name, layout in (("dp2", ["--pp", "1", "--dp", "2"]), ("tp2", ["--pp", "1", "--mp", "2"])):
        off = _gpt_step_time(work, f"{name}_off", layout, steps, 0)
        on = _gpt_step_time(work, f"{name}_on", layout, steps, 1)
        rows[name] = {"off": off, "on": on, "check_ms": 1e3 * (on - off), "ratio": on / off}
    return rows


LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
CPU_TRAINER = ["--output_dir", "unused", "--device", "cpu", "--bf16", "false", "--fp16", "false",
               "--amp_master_grad", "false", "--split_param", "false", "--report_to", "none", "--save_strategy", "no",
               "--seq_length", "16", "--num_samples", "64", "--max_steps", "2", "--per_device_train_batch_size", "4",
               "--gradient_accumulation_steps", "8"]
SIXTEEN = {
    "llama8b-tp4pp2dp2": ("tp4pp2dp2", 1, "trainer"),
    "llama8b-tp2pp4vp2dp2": ("tp2pp4vp2dp2", 1, "trainer"),
    "gpt-tp2pp2dp2-nnodes2": ("tp2pp2dp2", 2, "gpt"),
}


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every process below it (Linux /proc)."""
    children, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def _verify_with_memory(cmd: list, env: dict, timeout: float) -> tuple:
    """(exit code, output, wall seconds, peak resident bytes of its process tree)."""
    start, peak = time.time(), 0
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        if time.time() - start > timeout:
            proc.kill()
        time.sleep(0.2)
    reader.join()
    return proc.returncode, "".join(out), time.time() - start, peak


def measure_sixteen(work: str) -> dict:
    config = os.path.join(work, "llama-3-8b.json")
    with open(config, "w") as f:
        json.dump(LLAMA_3_8B, f)
    rows = {}
    for name, (layout, nnodes, script) in SIXTEEN.items():
        verdict = os.path.join(work, f"{name}.json")
        if script == "trainer":
            cmd = [sys.executable, "-m", "paddle_hybrid.verify", "--shrink-from", config, "--layouts", layout,
                   "--json", verdict, TRAINER, "--model_name_or_path", work, "--init_from_config", "true", *CPU_TRAINER]
        else:
            cmd = [sys.executable, "-m", "paddle_hybrid.verify", "--nnodes", str(nnodes), "--layouts", layout,
                   "--json", verdict, GPT, "--steps", "3", "--micro-batch-size", "8"]
        code, out, wall, peak = _verify_with_memory(cmd, _env(), 1800)
        result = {}
        if os.path.isfile(verdict):
            with open(verdict) as f:
                result = json.load(f)
        runs = result.get("seconds", {})
        rows[name] = {"layout": layout, "nnodes": nnodes, "exit": code, "wall_s": round(wall, 1),
                      "peak_rss_bytes": peak, "runs_s": {k: round(v, 1) for k, v in runs.items()},
                      "comparison_s": round(wall - sum(runs.values()), 1),
                      "equal": {k: v["equal"] for k, v in result.get("layouts", {}).items()},
                      "tail": out[-1500:] if code not in (0, 1) else ""}
        print(f"{name}: exit {code}, {wall:.0f} s, peak {peak / 2**30:.2f} GiB", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--case", choices=("verify", "sixteen"), default="verify")
    parser.add_argument("--out", default=os.path.join(RESULTS, "verify.json"))
    args = parser.parse_args()
    report = {"date": time.strftime("%Y-%m-%d")}
    if args.case == "sixteen":
        with tempfile.TemporaryDirectory() as work:
            report["sixteen"] = measure_sixteen(work)
        print(f"\n{'case':<24} {'exit':>4} {'wall s':>7} {'peak GiB':>9} {'runs (s)':<40} {'compare s':>9}  equal")
        for name, row in report["sixteen"].items():
            runs = ", ".join(f"{k} {v}" for k, v in row["runs_s"].items())
            print(f"{name:<24} {row['exit']:>4} {row['wall_s']:>7} {row['peak_rss_bytes'] / 2**30:>9.2f} {runs:<40} "
                  f"{row['comparison_s']:>9}  {row['equal']}")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    with tempfile.TemporaryDirectory() as work:
        report["verify"] = measure_verify(work)
        report["replica_check"] = measure_replica_check(work, args.steps)
    v = report["verify"]
    print(f"verify, tiny LLaMA Trainer, one + tp2, pp2, dp2, sharding2: {v['seconds']:.1f} s in all (target < 120 s); "
          f"runs: " + ", ".join(f"{k} {s:.1f} s" for k, s in v["runs"].items()) + f"; equal: {v['equal']}")
    print(f"\nreplica check every step, gpt_pp.py (default model), {args.steps} steps, median step time")
    print(f"{'layout':<8} {'off (ms)':>9} {'on (ms)':>9} {'a check (ms)':>13} {'on/off':>7}")
    for name, row in report["replica_check"].items():
        print(f"{name:<8} {row['off'] * 1e3:9.1f} {row['on'] * 1e3:9.1f} {row['check_ms']:13.1f} {row['ratio']:7.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
