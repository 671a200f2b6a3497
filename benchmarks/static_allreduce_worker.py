"""Worker of bench_static_allreduce.py: one rank of a 2-rank static DP step.

Model: a chain of ``--layers`` Linear(``--width``) layers (2 gradients each).
Variants, measured side by side in one process, rounds interleaved:

* ``unfused``: fleet + plugin with ``fuse_all_reduce_ops=False`` (one all_reduce per gradient);
* ``fused_default``: fleet + plugin with the strategy's defaults (``fuse_grad_size_in_MB`` 32,
  ``fuse_grad_size_in_num`` 8: groups of 8 gradients), what a user gets without tuning;
* ``fused_tuned``: fleet + plugin with ``fuse_grad_size_in_num=100000`` (one group: every
  gradient of this model fits in 32 MB);
* ``limit``: the same single-process training step plus ONE all_reduce of a
  preallocated persistable buffer with the bytes of all gradients, run
  through the same PIR path (no coalesce, no copy back).  Nothing depends on
  it, so the interpreter may overlap it with forward/backward;
* ``limit_ordered``: the same buffer and all_reduce, ordered like the fused
  one: ``ph_nop`` edges make it wait for the last gradient and make the
  optimizer wait for it.  The fused variant minus the copy in and out.
"""
import argparse
import time

import numpy as np
import paddle
import paddle.distributed.fleet as fleet
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

import paddle_hybrid  # noqa: F401
from paddle_hybrid import ops
from paddle_hybrid.common.program_edit import deferred_sync
from paddle_hybrid.static.fused_allreduce import StaticRunner, ensure_process_group, translate_with_repair
from paddle_hybrid.testing import save_result


def model(batch, width, layers):
    x = paddle.static.data("x", [batch, width], "float32")
    h = x
    for _ in range(layers):
        h = paddle.nn.functional.relu(paddle.nn.Linear(width, width)(h))
    loss = paddle.mean(paddle.square(h))
    return x, loss


def build_dp(args, fuse, num=None):
    """``num`` None: the strategy's default ``fuse_grad_size_in_num``."""
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_reduce_ops = fuse
    if num is not None:
        strategy.fuse_grad_size_in_num = num
    scope = paddle.static.Scope()
    with OldIrGuard(), unique_name.guard(), paddle.static.scope_guard(scope):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x, loss = model(args.batch, args.width, args.layers)
            fleet.distributed_optimizer(paddle.optimizer.SGD(0.01), strategy).minimize(loss)
        runner = StaticRunner(main, startup)
        runner.run_startup()
    n_ar = [op.type for op in main.global_block().ops].count("all_reduce")
    n_grads = sum(len(g.slots) for g in runner.layout.groups)

    def step(feed):
        with paddle.static.scope_guard(scope):
            runner.run(feed=feed, fetch_list=[loss])

    return step, n_ar, n_grads


def build_limit(args, ordered=False):
    scope = paddle.static.Scope()
    exe = paddle.static.Executor(paddle.CPUPlace())
    with OldIrGuard(), unique_name.guard(), paddle.static.scope_guard(scope):
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x, loss = model(args.batch, args.width, args.layers)
            _, pg = paddle.optimizer.SGD(0.01).minimize(loss)
            numel = sum(int(np.prod(g.shape)) for _, g in pg)
            buf = paddle.static.create_global_var([numel], 0.0, "float32", persistable=True, name="ph_bench_buf")
            block = main.global_block()
            allreduce = dict(type="all_reduce", inputs={"x": [buf]}, outputs={"out": [buf]},
                             attrs={"ring_id": 0, "reduce_type": 0})
            if not ordered:
                block.append_op(**allreduce)
            else:
                grads = [g for _, g in pg]
                first_opt = next(i for i, op in enumerate(block.ops) if op.type == "sgd")
                edge = lambda vs: dict(type=ops.NOP_OP, inputs={ops.NOP_IN: vs}, outputs={ops.NOP_OUT: vs})
                with deferred_sync(block):
                    # after the last gradient, before the first optimizer op
                    for k, spec in enumerate([edge([buf, *grads]), allreduce, edge([buf, *grads])]):
                        block._insert_op_without_sync(first_opt + k, **spec)
        exe.run(startup)
        prog, mapping = translate_with_repair(main)
    fetch = [mapping[loss.name][-1]]

    def step(feed):
        with paddle.static.scope_guard(scope), paddle.pir_utils.IrGuard():
            exe.run(prog, feed=feed, fetch_list=fetch)

    return step, 1, len(pg), numel * 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=110)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    paddle.enable_static()
    fleet.init(is_collective=True)
    ensure_process_group()
    rank = fleet.worker_index()
    variants = {}
    s, n, g = build_dp(args, fuse=False)
    variants["unfused"] = dict(step=s, allreduce=n, grads=g)
    s, n, g = build_dp(args, fuse=True)
    variants["fused_default"] = dict(step=s, allreduce=n, grads=g)
    s, n, g = build_dp(args, fuse=True, num=100000)
    variants["fused_tuned"] = dict(step=s, allreduce=n, grads=g)
    s, n, g, nbytes = build_limit(args)
    variants["limit"] = dict(step=s, allreduce=n, grads=g)
    s, n, g, _ = build_limit(args, ordered=True)
    variants["limit_ordered"] = dict(step=s, allreduce=n, grads=g)
    feed = {"x": np.random.default_rng(rank).standard_normal((args.batch, args.width)).astype("float32")}
    times = {k: [] for k in variants}
    for k, v in variants.items():  # warm up (first run translates and builds the executor)
        for _ in range(3):
            v["step"](feed)
    for _ in range(args.rounds):
        for k, v in variants.items():
            for _ in range(args.steps):
                t0 = time.perf_counter()
                v["step"](feed)
                times[k].append(time.perf_counter() - t0)
    save_result({
        "rank": rank,
        "grad_bytes": nbytes,
        "variants": {
            k: {"allreduce": v["allreduce"], "grads": v["grads"], "median_ms": 1000 * float(np.median(times[k])),
                "p10_ms": 1000 * float(np.percentile(times[k], 10)), "p90_ms": 1000 * float(np.percentile(times[k], 90))}
            for k, v in variants.items()
        },
    })


if __name__ == "__main__":
    main()
