"""Run every benchmark of paddle_hybrid, and the example with each feature on
and off, side by side in one run; write one Markdown table, JSON and a PNG bar
chart of the ratios.

    python benchmarks/run_all.py                # everything (~10 minutes on 2 cores)
    python benchmarks/run_all.py --quick        # smaller sizes (~4 minutes)
    python benchmarks/run_all.py --only static_allreduce grad_buckets

Each benchmark script runs in its own process and writes its JSON to
benchmarks/results/; this script reads those files back.  Outputs:
benchmarks/results/summary.{md,json,png} (the PNG when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, ROOT)


def _row(bench, measure, base_label, base, plug_label, plug, unit, ratio, target, met):
    return dict(benchmark=bench, measure=measure, baseline=base_label, baseline_value=base, plugin=plug_label,
                plugin_value=plug, unit=unit, ratio=ratio, target=target, met=met)


# --------------------------------------------------------------------------- per-benchmark readers
def rows_reshard(d):
    r = d["rows"]
    speed = r["stock"]["seconds"] / r["plugin"]["seconds"]
    return [
        _row("reshard", f"reshard time ({r['plugin']['inserted_ops']} inserted ops)", "stock", r["stock"]["seconds"],
             "plugin", r["plugin"]["seconds"], "s", speed, ">= 3x faster", speed >= 3),
        _row("reshard", "_sync_with_cpp calls", "stock", r["stock"]["syncs"], "plugin", r["plugin"]["syncs"], "calls",
             r["stock"]["syncs"] / max(1, r["plugin"]["syncs"]), f"<= blocks ({r['plugin']['blocks']})",
             r["plugin"]["syncs"] <= r["plugin"]["blocks"]),
    ]


def rows_pipeline_rewrite(d):
    out = []
    for sched, res in d["results"].items():
        per, dfr = res["rows"]["per-insert"], res["rows"]["deferred"]
        out.append(_row("pipeline send-wait", f"{sched} rewrite ({dfr['waits_removed_per_step']} waits removed/step)",
                        "per-insert sync", per["rewrite_s"], "deferred sync", dfr["rewrite_s"], "s",
                        per["rewrite_s"] / dfr["rewrite_s"], "syncs O(blocks)", dfr["syncs"] <= 2))
    return out


STATIC_FUSED = (("fused_default", "fused (default: 8 per group)"),
                ("fused_tuned", "fused (tuned: one group, fuse_grad_size_in_num=100000)"))


def rows_static_allreduce(d):
    """Paddle's default grouping first, then the tuned one; the targets apply to both rows."""
    r, q = d["rows"], d["ratios"]
    out = []
    for key, label in STATIC_FUSED:
        out.append(_row("static fused allreduce", f"step, {r[key]['grads']} grads, 2 ranks ({r[key]['allreduce']} "
                        "all_reduce)", "unfused", r["unfused"]["median_ms"], label, r[key]["median_ms"], "ms",
                        q[key]["unfused_over_fused"], ">= 10x faster", q[key]["unfused_over_fused"] >= 10))
    for key, label in STATIC_FUSED:
        out.append(_row("static fused allreduce", "step vs one preallocated all_reduce", "limit",
                        r["limit"]["median_ms"], label, r[key]["median_ms"], "ms", q[key]["fused_over_limit"],
                        "fused/limit <= 1.5", q[key]["fused_over_limit"] <= 1.5))
    return out


def rows_grad_buckets(d):
    m = d["median_ms_per_step"]
    s1, s2 = d["speedup_vs_fused_allreduce_gradients"], d["buckets_over_prealloc_limit"]
    return [
        _row("dygraph grad buckets", "grad sync, 220 params, DP=2", "fused_allreduce_gradients",
             m["fused_allreduce_gradients"], "buckets", m["buckets"], "ms", s1, ">= 1.5x faster", s1 >= 1.5),
        _row("dygraph grad buckets", "grad sync vs preallocated all_reduce", "limit", m["prealloc_limit"], "buckets",
             m["buckets"], "ms", s2, "buckets/limit <= 1.3", s2 <= 1.3),
        _row("dygraph grad buckets", "grad sync vs per-parameter", "per-parameter", m["per_param"], "buckets",
             m["buckets"], "ms", d["speedup_vs_per_param"], "-", None),
    ]


def rows_tensor_parallel(d):
    r, c = d["rows"], d["config"]
    one, tp = r["1 process"], r["TP=2, 2 processes"]
    ratio = d["tp2_over_one_tokens_per_s"]
    return [
        _row("tensor parallel (CPU)", f"tokens/s, gpt_pp hidden {c['hidden']}, {c['layers']} blocks, 1 thread/process",
             "1 process", one["tokens_per_s"], "TP=2 on 2 processes", tp["tokens_per_s"], "tok/s", ratio,
             ">= 1.3x", ratio >= 1.3),
        _row("tensor parallel (CPU)", "tokens/s, same, tuned: + sequence parallel", "1 process", one["tokens_per_s"],
             "TP=2 + SP on 2 processes", r["TP=2 + sequence parallel (tuned)"]["tokens_per_s"], "tok/s",
             d["tp2_sp_over_one_tokens_per_s"], "-", None),
        _row("tensor parallel (CPU)", "time in TP collectives per step", "step", 1000 * tp["median_step_s"],
             "collectives", 1000 * tp["tp_collective_s_per_step"], "ms",
             tp["tp_collective_s_per_step"] / tp["median_step_s"], "share of the step", None),
    ]


def rows_timeline(d):
    r = d["rows"]
    base, rec = r["PP=2, no recording"]["median_step_s"], r["PP=2, --timeline"]["median_step_s"]
    return [_row("timeline recording", "step time, gpt_pp.py PP=2 defaults", "no recording", 1000 * base,
                 "--timeline", 1000 * rec, "ms", base / rec, "overhead <= 3%", d["met"])]


def rows_cpu_blas(d):
    r = d["rows"]
    return [_row("CPU BLAS (AMD, MKL 2019)", "paddle.matmul GFLOP/s (CPU time), 1 thread", "avx2 reference",
                 r["avx2 reference"]["gflops_cpu"]["median"], "plugin", r["plugin"]["gflops_cpu"]["median"], "GFLOP/s",
                 d["plugin_over_avx2"], f">= {d['target']} of AVX2", d["met"]),
            _row("CPU BLAS (AMD, MKL 2019)", "same, against stock", "stock", r["stock"]["gflops_cpu"]["median"],
                 "plugin", r["plugin"]["gflops_cpu"]["median"], "GFLOP/s", d["plugin_over_stock"], "-", None)]


def rows_vs_pytorch(d):
    out = []
    for layout in dict.fromkeys((r["shape"], r["layout"]) for r in d["rows"]):
        pd, pt = (next(r for r in d["rows"] if (r["shape"], r["layout"]) == layout and r["framework"] == fw)
                  for fw in ("Paddle", "PyTorch"))
        if pd.get("tokens_per_s") and pt.get("tokens_per_s"):
            out.append(_row("vs PyTorch (CPU, gloo)", f"tokens/s, {layout[0]} shape, {layout[1]}", "PyTorch",
                            pt["tokens_per_s"], "Paddle + plugin", pd["tokens_per_s"], "tok/s",
                            pd["tokens_per_s"] / pt["tokens_per_s"], "-", None))
    return out


def rows_gloo_kernels(d):
    """The largest size of each rank count: the reduce_scatter and all_to_all kernels against an
    all_reduce of the same bytes (targets 0.7 and 1.0)."""
    out = []
    for ranks, rows in d["ranks"].items():
        kb = str(max(d["sizes_kb"]))
        cell = rows[kb]
        for kernel, target in (("rs_kernel", 0.7), ("a2a_kernel", 1.0)):
            ratio = cell[kernel] / cell["all_reduce"]
            out.append(_row("gloo kernels", f"{kernel.split('_')[0]} vs all_reduce, {ranks} ranks, {kb} KB a rank",
                            "all_reduce", 1000 * cell["all_reduce"], kernel, 1000 * cell[kernel], "ms", ratio,
                            f"<= {target}", ratio <= target))
    return out


def rows_verify(d):
    """The verifier's wall time (target 120 s) and the replica check's cost (a check every step)."""
    out = [_row("verify", "tiny LLaMA Trainer: one + tp2, pp2, dp2, sharding2", "target", 120.0, "verify",
                d["verify"]["seconds"], "s", d["verify"]["seconds"] / 120.0, "< 120 s", d["verify"]["seconds"] < 120)]
    for name, row in d["replica_check"].items():
        out.append(_row("replica check", f"gpt_pp.py {name}, a check every step", "off", 1e3 * row["off"], "on",
                        1e3 * row["on"], "ms/step", row["ratio"], "reported", True))
    return out


BENCHES = {
    "cpu_blas": ("bench_cpu_blas.py", [], ["--rounds", "2"], "cpu_blas.json", rows_cpu_blas),
    "reshard": ("bench_reshard.py", [], ["--layers", "24"], "reshard.json", rows_reshard),
    "pipeline_rewrite": ("bench_pipeline_rewrite.py", [], ["--branches", "128"], "pipeline_rewrite.json",
                         rows_pipeline_rewrite),
    "static_allreduce": ("bench_static_allreduce.py", [], ["--rounds", "2"], "static_allreduce.json",
                         rows_static_allreduce),
    "grad_buckets": ("bench_grad_buckets.py", [], ["--iters", "15"], "grad_buckets.json", rows_grad_buckets),
    "tensor_parallel": ("bench_tensor_parallel.py", [], ["--rounds", "1", "--steps", "5"], "tensor_parallel.json",
                        rows_tensor_parallel),
    "timeline": ("bench_timeline.py", [], ["--rounds", "1", "--steps", "10"], "timeline.json", rows_timeline),
    "vs_pytorch": ("bench_vs_pytorch.py", [], ["--rounds", "1", "--steps", "5"], "vs_pytorch.json", rows_vs_pytorch),
    "gloo_kernels": ("bench_gloo_kernels.py", [], ["--max-mb", "16"], "gloo_kernels.json", rows_gloo_kernels),
    "verify": ("bench_verify.py", [], ["--steps", "6"], "verify.json", rows_verify),
}
NEEDS = {"vs_pytorch": "torch", "verify": "paddleformers"}  # benchmarks that run only when this module is importable

# The example, each feature on and off: (name, nprocs, extra args, env)
EXAMPLE_SHAPE = ["--layers", "4", "--hidden", "64", "--seq-len", "64", "--micro-batch-size", "4",
                 "--accumulate-steps", "4"]
EXAMPLES = [
    ("pp2", 2, ["--pp", "2"], {}),
    ("pp2 + cudagraph (CPU emulation)", 2, ["--pp", "2", "--cudagraph"], {}),
    ("pp2 x dp2, Paddle's fused_allreduce_gradients", 4, ["--pp", "2", "--dp", "2", "--fuse-allreduce"],
     {"PADDLE_HYBRID_GRAD_BUCKETS": "0"}),
    ("pp2 x dp2, plugin grad buckets", 4, ["--pp", "2", "--dp", "2", "--fuse-allreduce"], {}),
]


def run_bench(name, quick, timeout):
    script, args, quick_args, json_name, _ = BENCHES[name]
    cmd = [sys.executable, os.path.join(HERE, script), *args, *(quick_args if quick else [])]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-2500:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(RESULTS, json_name)) as f:
        return json.load(f), time.time() - t0


def run_examples(steps, timeout):
    from paddle_hybrid.testing import launch

    script = os.path.join(ROOT, "examples", "gpt_pp.py")
    out = {}
    for label, nprocs, extra, env in EXAMPLES:
        args = EXAMPLE_SHAPE + extra + ["--steps", str(steps), "--out-dir", os.path.join(RESULTS, "gpt_pp")]
        res = launch(script, nprocs=nprocs, args=args, timeout=timeout, env=env)
        s = res[0]["summary"]
        times = s["step_times"][2:] or s["step_times"]
        out[label] = dict(tokens_per_s=s["tokens_per_s"], step_ms=1000 * sorted(times)[len(times) // 2],
                          first_loss=s["first_loss"], final_loss=s["final_loss"], nprocs=nprocs)
        print(f"  {label}: {out[label]['step_ms']:.0f} ms/step, {s['tokens_per_s']:.0f} tok/s, "
              f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}", flush=True)
    return out


def example_rows(ex):
    rows = []
    pairs = [("pp2", "pp2 + cudagraph (CPU emulation)", "overhead of the emulation (CPU)"),
             ("pp2 x dp2, Paddle's fused_allreduce_gradients", "pp2 x dp2, plugin grad buckets", "DP grad sync")]
    for base, plug, what in pairs:
        if base in ex and plug in ex:
            b, p = ex[base]["step_ms"], ex[plug]["step_ms"]
            rows.append(_row("gpt_pp.py example", f"step time, {what}", base, b, plug, p, "ms", b / p, "-", None))
    return rows


def markdown(rows, meta):
    lines = [f"Run {meta['date']} on {meta['machine']} (Paddle {meta['paddle']}); ratio = baseline / plugin for "
             "times (higher is better) except where the target says otherwise.", "",
             "| benchmark | measure | baseline | plugin | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        fmt = (lambda v: f"{v:.3g} {r['unit']}")
        lines.append(f"| {r['benchmark']} | {r['measure']} | {r['baseline']}: {fmt(r['baseline_value'])} | "
                     f"{r['plugin']}: {fmt(r['plugin_value'])} | {r['ratio']:.2f} | {r['target']} | {met} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['benchmark']}\n{r['measure'][:38]}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.5))
    colors = ["tab:green" if r["met"] else ("tab:red" if r["met"] is False else "tab:gray") for r in rows]
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("ratio (see table; green: target met, red: not met, grey: no target)")
    ax.set_title("paddle_hybrid benchmarks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes for every benchmark")
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {sorted(BENCHES)} and 'example'")
    ap.add_argument("--example-steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()
    chosen = args.only if args.only is not None else [*BENCHES, "example"]
    unknown = set(chosen) - set(BENCHES) - {"example"}
    if unknown:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {sorted(BENCHES)} and 'example'")
    os.makedirs(RESULTS, exist_ok=True)
    import paddle

    meta = {"date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.system()}, no GPU"
            if not paddle.is_compiled_with_cuda() else f"{platform.machine()} with CUDA",
            "paddle": paddle.__version__, "quick": args.quick}
    rows, raw, seconds = [], {}, {}
    for name in chosen:
        print(f"== {name}", flush=True)
        if name == "example":
            t0 = time.time()
            raw[name] = run_examples(args.example_steps, args.timeout)
            seconds[name] = time.time() - t0
            rows += example_rows(raw[name])
            continue
        if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
            print(f"skipped: {NEEDS[name]} not installed", flush=True)
            continue
        raw[name], seconds[name] = run_bench(name, args.quick, args.timeout)
        rows += BENCHES[name][4](raw[name])
    md = markdown(rows, meta)
    print(md)
    with open(os.path.join(RESULTS, "summary.md"), "w") as f:
        f.write(md)
    with open(os.path.join(RESULTS, "summary.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "seconds": seconds, "raw": raw}, f, indent=1)
    if plot(rows, os.path.join(RESULTS, "summary.png")):
        print(f"chart: {os.path.join('benchmarks', 'results', 'summary.png')}")
    print("wall seconds per benchmark:", {k: round(v) for k, v in seconds.items()})


if __name__ == "__main__":
    main()
