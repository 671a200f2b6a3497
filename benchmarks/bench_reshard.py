"""Legacy auto-parallel reshard: stock Paddle vs the plugin, side by side.

Builds the same program three times (a stack of LayerNorm / column-split
Linear / gelu / replicated Linear blocks on an mp x pp cluster, cut so that
every block boundary crosses stages: reshard inserts 1000+ ops on the chosen
rank; see ``paddle_hybrid/testing/static_programs.py``), reshards it

* ``stock``:    Paddle's ``Resharder.reshard`` (a ``_sync_with_cpp`` per insert),
* ``deferred``: the plugin's wrapper with deferred sync only,
* ``plugin``:   deferred sync + indexed process-group lookups (what ``import
  paddle_hybrid`` installs),

checks that the three programs are identical (ops, vars, attrs, dist attrs,
process groups), prints a table and writes ``benchmarks/results/reshard.json``.

Targets: ``_sync_with_cpp`` calls O(blocks), not O(inserts); plugin reshard at
least 3x faster than stock.

    python benchmarks/bench_reshard.py [--mp 16] [--pp 2] [--layers 48] [--rank 16] [--repeats 1]
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
from paddle.base import framework  # noqa: E402

import paddle_hybrid  # noqa: E402
from paddle_hybrid import PluginConfig  # noqa: E402
from paddle_hybrid.static.reshard import deferred as reshard_patch  # noqa: E402
from paddle_hybrid.testing.sync_count import count_syncs  # noqa: E402
from paddle_hybrid.testing.static_programs import (  # noqa: E402
    build_auto_parallel_program,
    dist_signature,
    process_groups,
    program_signature,
    run_reshard,
)

VARIANTS = ("stock", "deferred", "plugin")


@contextlib.contextmanager
def _variant(name):
    was = reshard_patch.is_installed()
    paddle_hybrid.uninstall_component("reshard")
    saved = reshard_patch._indexed_process_groups
    try:
        if name != "stock":
            paddle_hybrid.install_component("reshard", PluginConfig())
            if not reshard_patch.is_installed():
                raise SystemExit("the reshard patch did not install on this Paddle (see the warning above)")
        if name == "deferred":
            reshard_patch._indexed_process_groups = contextlib.nullcontext
        yield
    finally:
        reshard_patch._indexed_process_groups = saved
        paddle_hybrid.uninstall_component("reshard")
        if was:
            paddle_hybrid.install_component("reshard", PluginConfig())


@contextlib.contextmanager
def _count_inserts():
    original = framework.Block._insert_op_without_sync  # both insert paths end here
    count = [0]

    def counting(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    framework.Block._insert_op_without_sync = counting
    try:
        yield count
    finally:
        framework.Block._insert_op_without_sync = original


def run_one(name, args):
    with _variant(name), paddle.pir_utils.OldIrGuard():
        main, startup, ctx, pgrads = build_auto_parallel_program(
            args.rank, mp=args.mp, pp=args.pp, layers=args.layers, hidden=args.hidden,
            batch=args.mp, layer_norm=True, stress=True)
        ops_before = len(main.global_block().ops)
        with count_syncs() as syncs, _count_inserts() as inserts:
            t0 = time.perf_counter()
            run_reshard(args.rank, main, startup, ctx, pgrads)
            seconds = time.perf_counter() - t0
        signature = (program_signature(main), program_signature(startup), dist_signature(main, ctx),
                     process_groups())
        return {
            "seconds": seconds,
            "syncs": syncs.total,
            "inserted_ops": inserts[0],
            "ops_before": ops_before,
            "ops_after": len(main.global_block().ops),
            "blocks": main.num_blocks + startup.num_blocks,
        }, signature


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mp", type=int, default=16)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16, help="rank whose program is resharded")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of (stock, deferred, plugin); best time kept")
    args = ap.parse_args()

    rows, reference = {}, None
    for _ in range(args.repeats):
        for name in VARIANTS:
            row, signature = run_one(name, args)
            if reference is None:
                reference = signature
            elif signature != reference:
                raise SystemExit(f"{name}: resharded program differs from stock's")
            if name not in rows or row["seconds"] < rows[name]["seconds"]:
                rows[name] = row
    stock = rows["stock"]["seconds"]
    print(f"reshard of rank {args.rank}, mp={args.mp} x pp={args.pp}, {args.layers} blocks: "
          f"{rows['stock']['ops_before']} ops before, {rows['stock']['inserted_ops']} inserted; "
          "programs identical in all variants")
    print(f"{'variant':<10}{'inserted ops':>14}{'_sync_with_cpp':>16}{'reshard s':>12}{'speed-up':>10}")
    for name in VARIANTS:
        r = rows[name]
        print(f"{name:<10}{r['inserted_ops']:>14}{r['syncs']:>16}{r['seconds']:>12.2f}{stock / r['seconds']:>9.1f}x")
    plugin = rows["plugin"]
    ok = plugin["syncs"] <= plugin["blocks"] and stock / plugin["seconds"] >= 3 and plugin["inserted_ops"] >= 1000
    print(f"plugin: {plugin['syncs']} syncs for {plugin['blocks']} blocks (target <= blocks), "
          f"{stock / plugin['seconds']:.1f}x faster (target >= 3x), {plugin['inserted_ops']} inserts "
          f"(case needs >= 1000) -> {'MET' if ok else 'NOT MET'}")
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "reshard.json"), "w") as f:
        json.dump({"config": vars(args), "paddle": paddle.__version__, "rows": rows,
                   "speedup": {k: stock / rows[k]["seconds"] for k in VARIANTS},
                   "identical_programs": True, "targets_met": ok}, f, indent=2)


if __name__ == "__main__":
    main()
