"""Paddle's CPU matmul with and without the plugin's BLAS setting (paddle_hybrid.cpu_blas).

Every measurement is a fresh process (MKL chooses its kernels once per process), one OpenMP
thread, rounds alternated so drift of a shared machine hits every variant:

* ``stock``: ``import paddle`` only, ``MKL_DEBUG_CPU_TYPE`` unset;
* ``plugin``: ``import paddle_hybrid`` first (the variable unset at start: the component sets it);
* ``avx2 reference``: ``MKL_DEBUG_CPU_TYPE=5`` exported before Python starts (MKL's AVX2 path
  as far as this MKL has one: the best the setting can give).

Per process: ``paddle.matmul`` (M x K) @ (K x N) fp32, GFLOP/s of the best of ``--reps`` calls,
timed by the thread's CPU time (what a core delivers, insensitive to other processes taking the
core) and by the wall clock.  Writes benchmarks/results/cpu_blas.json.

With ``--example``: also examples/gpt_pp.py's default GPT (its model and step, ``--example-steps``
steps) PP1 on 1 process and PP2 on 2 processes, with the component (default) and without
(``PADDLE_HYBRID_CPU_BLAS=0``), alternated; median step after 2 warm-up steps: tokens/s by the
wall clock and CPU seconds per step over all ranks (the part a busy machine does not blur).

    python benchmarks/bench_cpu_blas.py                  # 1024x512 @ 512x2048, 5 rounds
    python benchmarks/bench_cpu_blas.py --rounds 3 --m 512
    python benchmarks/bench_cpu_blas.py --example --example-rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
VARIABLE = "MKL_DEBUG_CPU_TYPE"
# (label, import the plugin first, environment added at process start)
VARIANTS = [("stock", False, {}), ("plugin", True, {}), ("avx2 reference", False, {VARIABLE: "5"})]
TARGET = 0.85  # plugin / avx2 reference


def child(plugin: bool, m: int, k: int, n: int, reps: int) -> dict:
    """One measurement, in this (fresh) process."""
    if plugin:
        import paddle_hybrid  # noqa: F401  (before the first BLAS call)
    import paddle

    a, b = paddle.randn([m, k]), paddle.randn([k, n])
    for _ in range(2):  # MKL's first call chooses its kernels and allocates buffers
        paddle.matmul(a, b).numpy()
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.thread_time(), time.perf_counter()
        paddle.matmul(a, b).numpy()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    flop = 2.0 * m * k * n
    out = {"gflops_cpu": flop / min(cpu) / 1e9, "gflops_wall": flop / min(wall) / 1e9,
           "variable": os.environ.get(VARIABLE)}
    if plugin:
        state = paddle_hybrid.catalog.install.component_state("cpu_blas")
        out["component"] = f"{state.status}: {state.reason}"
    return out


def measure(label: str, plugin: bool, env_add: dict, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""), **env_add})
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(int(plugin)), "--m", str(args.m),
           "--k", str(args.k), "--n", str(args.n), "--reps", str(args.reps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_cpu_blas: {label} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# (label, processes = pipeline stages, environment of the run)
EXAMPLE_RUNS = [("PP1, without", 1, {"PADDLE_HYBRID_CPU_BLAS": "0"}), ("PP1, with", 1, {}),
                ("PP2, without", 2, {"PADDLE_HYBRID_CPU_BLAS": "0"}), ("PP2, with", 2, {})]


def run_example(nprocs: int, env_add: dict, steps: int, timeout: float) -> dict:
    """gpt_pp.py's default GPT, PP = ``nprocs``: tokens/s of the median step (wall clock, a step
    lasting as long as its slowest rank) and CPU seconds per step summed over the ranks."""
    from paddle_hybrid.testing import launch

    os.environ.pop(VARIABLE, None)  # this process's plugin set it; the runs decide for themselves
    res = launch(os.path.join(HERE, "gpt_worker.py"), nprocs=nprocs, timeout=timeout,
                 args=["--pp", str(nprocs), "--steps", str(steps)],
                 env={"OMP_NUM_THREADS": "1", **env_add})
    warm = 2
    n = len(res[0]["steps"])
    wall = [max(r["steps"][i]["wall"] for r in res) for i in range(warm, n)]
    cpu = [sum(r["steps"][i]["cpu"] for r in res) for i in range(warm, n)]
    return {"tokens_per_s": res[0]["tokens_per_step"] / statistics.median(wall),
            "cpu_s_per_step": statistics.median(cpu), "final_loss": res[-1]["loss"],
            "variable": sorted({str(r["variable"]) for r in res}), "mkl_cpu_type": sorted({r["mkl_cpu_type"] for r in res})}


def example_table(rounds: int, steps: int, timeout: float) -> dict:
    runs = {label: [] for label, _, _ in EXAMPLE_RUNS}
    for _ in range(rounds):
        for label, nprocs, env_add in EXAMPLE_RUNS:
            runs[label].append(run_example(nprocs, env_add, steps, timeout))
    rows = {label: {"tokens_per_s": summarize([r["tokens_per_s"] for r in rs]),
                    "cpu_s_per_step": summarize([r["cpu_s_per_step"] for r in rs]),
                    "final_loss": [r["final_loss"] for r in rs], "variable": rs[0]["variable"],
                    "mkl_cpu_type": rs[0]["mkl_cpu_type"]} for label, rs in runs.items()}
    print(f"examples/gpt_pp.py defaults, {steps} steps, OMP_NUM_THREADS=1, {rounds} alternated round(s); median step "
          "after 2 warm-up steps: tokens/s (wall clock) and CPU s per step (all ranks)")
    for layout in ("PP1", "PP2"):
        off, on = rows[f"{layout}, without"], rows[f"{layout}, with"]
        t0, t1, c0, c1 = off["tokens_per_s"], on["tokens_per_s"], off["cpu_s_per_step"], on["cpu_s_per_step"]
        print(f"{layout}: tokens/s without {t0['median']:6.0f} [{t0['min']:.0f}-{t0['max']:.0f}] with {t1['median']:6.0f} "
              f"[{t1['min']:.0f}-{t1['max']:.0f}] ({t1['median'] / t0['median']:.2f}x); CPU s/step without "
              f"{c0['median']:.3f} [{c0['min']:.3f}-{c0['max']:.3f}] with {c1['median']:.3f} [{c1['min']:.3f}-"
              f"{c1['max']:.3f}] ({c0['median'] / c1['median']:.2f}x); MKL CPU type without {off['mkl_cpu_type']} "
              f"with {on['mkl_cpu_type']}")
    return rows


def summarize(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def machine_facts() -> dict:
    sys.path.insert(0, ROOT)
    from paddle_hybrid.cpu_blas import decide, machine
    from paddle_hybrid.cpu_blas.decision import format_version

    facts = machine.gather({k: v for k, v in os.environ.items() if k != VARIABLE})
    return {"vendor": facts.vendor, "mkl": format_version(facts.mkl_version) if facts.mkl_version else facts.mkl_note,
            "decision": decide(facts).reason}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=1024)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--example", action="store_true", help="also time examples/gpt_pp.py PP1 and PP2 with and without")
    ap.add_argument("--example-steps", type=int, default=8)
    ap.add_argument("--example-rounds", type=int, default=2)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(bool(args.child), args.m, args.k, args.n, args.reps)))
        return
    runs = {label: [] for label, _, _ in VARIANTS}
    for _ in range(args.rounds):
        for label, plugin, env_add in VARIANTS:
            runs[label].append(measure(label, plugin, env_add, args))
    rows = {label: {"gflops_cpu": summarize([r["gflops_cpu"] for r in rs]),
                    "gflops_wall": summarize([r["gflops_wall"] for r in rs]),
                    "variable_seen": sorted({str(r["variable"]) for r in rs}),
                    "component": sorted({r.get("component", "-") for r in rs})} for label, rs in runs.items()}
    ref = rows["avx2 reference"]["gflops_cpu"]["median"]
    ratio = rows["plugin"]["gflops_cpu"]["median"] / ref
    speedup = rows["plugin"]["gflops_cpu"]["median"] / rows["stock"]["gflops_cpu"]["median"]
    facts = machine_facts()
    out = {"config": {k: v for k, v in vars(args).items() if k != "child"}, "machine": facts, "rows": rows,
           "plugin_over_avx2": ratio, "plugin_over_stock": speedup, "target": TARGET, "met": ratio >= TARGET,
           "runs": runs}
    print(f"paddle.matmul {args.m}x{args.k} @ {args.k}x{args.n} fp32, 1 thread, best of {args.reps} per process, "
          f"{args.rounds} alternated rounds of fresh processes; CPU {facts['vendor']}, MKL {facts['mkl']}")
    print(f"{'variant':16s} {'GFLOP/s (CPU time) median [min-max]':>38s} {'GFLOP/s (wall) median [min-max]':>34s}  "
          f"{VARIABLE}")
    for label, r in rows.items():
        c, w = r["gflops_cpu"], r["gflops_wall"]
        print(f"{label:16s} {c['median']:20.1f} [{c['min']:5.1f}-{c['max']:5.1f}] {w['median']:18.1f} "
              f"[{w['min']:5.1f}-{w['max']:5.1f}]  {','.join(r['variable_seen'])}")
    print(f"plugin / avx2 reference: {ratio:.2f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'}); "
          f"plugin / stock: {speedup:.2f}x")
    print(f"decision here: {facts['decision']}")
    if args.example:
        out["example"] = example_table(args.example_rounds, args.example_steps, args.timeout)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "cpu_blas.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
