"""Pipeline send-wait rewrite: build + rewrite time, deferred sync vs per-insert sync.

Builds stage 0 of a static pipeline with Paddle's ``PipelineOptimizer`` (a model
of ``--branches`` parallel chains of fc layers over ``--stages`` stages, so
stage 0 sends ``--branches`` activations forward per microbatch; see
``paddle_hybrid/testing/static_programs.py``), then applies
``paddle_hybrid.static.send_wait.rewrite`` to identical copies

* ``per-insert``: every insert/remove syncs the block (``Block._insert_op``),
* ``deferred``:   as shipped, inside ``program_edit.deferred_sync``,

checks that both give the same program, and reports the waits for forward
sends removed per training step (per microbatch x ``--microbatches``).  Prints
a table and writes ``benchmarks/results/pipeline_rewrite.json``.

    python benchmarks/bench_pipeline_rewrite.py [--branches 256] [--stages 2] [--microbatches 8]
"""
import argparse
import contextlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import paddle  # noqa: E402

import paddle_hybrid  # noqa: E402,F401
from paddle_hybrid.testing.sync_count import count_syncs  # noqa: E402
from paddle_hybrid.static.send_wait import check_send_lifetimes  # noqa: E402
from paddle_hybrid.static.send_wait import rewrite as pass_module  # noqa: E402
from paddle_hybrid.testing.static_programs import build_pipeline_program, program_signature  # noqa: E402


@contextlib.contextmanager
def _per_insert_sync():
    """The same pass with deferred_sync switched off: Paddle's per-call syncs."""
    saved = pass_module.deferred_sync
    pass_module.deferred_sync = lambda target: contextlib.nullcontext()
    try:
        yield
    finally:
        pass_module.deferred_sync = saved


def run(schedule, args):
    build = lambda: build_pipeline_program(  # noqa: E731
        0, stages=args.stages, schedule=schedule, branches=args.branches, micro_batch=2,
        microbatches=args.microbatches, upstream_send_sync_opt=False)
    t0 = time.perf_counter()
    program = build()
    build_s = time.perf_counter() - t0
    ops_before = len(program.global_block().ops)
    rows, signatures = {}, {}
    for variant in ("per-insert", "deferred"):
        prog = program.clone() if variant == "per-insert" else program
        ctx = _per_insert_sync() if variant == "per-insert" else contextlib.nullcontext()
        with ctx, count_syncs() as syncs:
            t0 = time.perf_counter()
            result = pass_module.apply_pipeline_send_wait(prog)
            seconds = time.perf_counter() - t0
        check_send_lifetimes(prog)
        signatures[variant] = program_signature(prog)
        waits = len(result.removed_syncs) + len(result.async_sends)
        rows[variant] = {"rewrite_s": seconds, "syncs": syncs.total, "edits": len(result.removed_syncs)
                         + 2 * len(result.async_sends) + len(result.nops) + result.removed_upstream_nops,
                         "waits_removed_per_microbatch": waits,
                         "waits_removed_per_step": waits * args.microbatches,
                         "nops_inserted": len(result.nops)}
    if signatures["per-insert"] != signatures["deferred"]:
        raise SystemExit(f"{schedule}: deferred and per-insert rewrites differ")
    return {"build_s": build_s, "ops": ops_before, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--branches", type=int, default=256, help="parallel fc chains (forward sends per stage)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    results = {}
    with paddle.pir_utils.OldIrGuard():
        for schedule in ("1F1B", "F-then-B"):
            results[schedule] = run(schedule, args)
    print(f"stage 0 of {args.stages}, {args.branches * args.stages} fc layers, {args.microbatches} microbatches "
          "per step; rewritten programs identical in both variants, lifetimes checked")
    print(f"{'schedule':<10}{'ops':>6}{'build s':>9}{'variant':>12}{'edits':>7}{'syncs':>7}{'rewrite s':>11}"
          f"{'speed-up':>10}{'waits removed/step':>20}")
    for schedule, res in results.items():
        base = res["rows"]["per-insert"]["rewrite_s"]
        for variant, r in res["rows"].items():
            print(f"{schedule:<10}{res['ops']:>6}{res['build_s']:>9.2f}{variant:>12}{r['edits']:>7}{r['syncs']:>7}"
                  f"{r['rewrite_s']:>11.3f}{base / r['rewrite_s']:>9.1f}x{r['waits_removed_per_step']:>20}")
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "pipeline_rewrite.json"), "w") as f:
        json.dump({"config": vars(args), "paddle": paddle.__version__, "results": results,
                   "identical_programs": True}, f, indent=2)


if __name__ == "__main__":
    main()
