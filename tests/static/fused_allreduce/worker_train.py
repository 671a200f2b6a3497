"""Worker of the 2-rank static data-parallel tests (one launch, several runs).

For each configuration: build the legacy program, ``fleet.distributed_optimizer
(...).minimize``, run it with ``paddle_hybrid.static.fused_allreduce.StaticRunner`` for
a few steps on this rank's half of the batch, and report parameters, losses and
program structure.  Rank 0 also trains each model in one process on the full
batch (no fleet).  Last, rank 1 builds a different model to trigger the layout
check; both ranks report the error.
"""
import argparse
import os
import sys
import traceback

import numpy as np
import paddle
import paddle.distributed.fleet as fleet
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import paddle_hybrid  # noqa: E402,F401
from paddle_hybrid.static.fused_allreduce import StaticRunner  # noqa: E402
from paddle_hybrid.common.layout_check import LayoutMismatchError  # noqa: E402
from paddle_hybrid.testing import save_result  # noqa: E402

GLOBAL_BATCH = 8


def make_optimizer(kind):
    if kind == "mlp":
        return paddle.optimizer.SGD(learning_rate=0.1)
    # epsilon 1e-4: the key bias has an exactly-zero gradient (softmax is shift
    # invariant); Adam's default 1e-8 would blow its rounding noise up into
    # lr-sized steps that differ with any change of summation order.
    return paddle.optimizer.Adam(learning_rate=0.01, epsilon=1e-4, grad_clip=paddle.nn.ClipGradByNorm(0.5))


def param_names(program):
    return sorted(p.name for p in program.global_block().all_parameters())


def run_dp(kind, steps, rank, nranks, fuse, mb=32, num=8, model_kw=None, init_seed=None):
    strategy = fleet.DistributedStrategy()
    strategy.fuse_all_reduce_ops = fuse
    strategy.fuse_grad_size_in_MB = mb
    strategy.fuse_grad_size_in_num = num
    local = GLOBAL_BATCH // nranks
    with OldIrGuard(), unique_name.guard(), paddle.static.scope_guard(paddle.static.Scope()):
        main, startup = paddle.static.Program(), paddle.static.Program()
        # a different seed per rank: equal parameters after startup prove the broadcast
        startup.random_seed = 100 + (rank if init_seed is None else init_seed)
        with paddle.static.program_guard(main, startup):
            x, y, loss = models.build(kind, local, **(model_kw or {}))
            opt = fleet.distributed_optimizer(make_optimizer(kind), strategy)
            opt.minimize(loss)
        runner = StaticRunner(main, startup)
        runner.run_startup()
        names = param_names(main)
        init = {n: runner.param(n) for n in names}
        losses = []
        for bx, by in models.data(kind, GLOBAL_BATCH, steps):
            sl = slice(rank * local, (rank + 1) * local)
            (lv,) = runner.run(feed={"x": bx[sl], "y": by[sl]}, fetch_list=[loss])
            losses.append(float(lv))
        ops = [op.type for op in main.global_block().ops]
        return {
            "init": init,
            "params": {n: runner.param(n) for n in names},
            "losses": losses,
            "num_allreduce": ops.count("all_reduce"),
            "num_coalesce": ops.count("ph_coalesce_tensor"),
            "groups": runner.layout.describe(),
            "fingerprint": runner.fingerprint,
            "applied": list(fleet.fleet._context.get("applied_meta_list", [])),
        }


def run_single(kind, steps, init_seed=100):
    with OldIrGuard(), unique_name.guard(), paddle.static.scope_guard(paddle.static.Scope()):
        main, startup = paddle.static.Program(), paddle.static.Program()
        startup.random_seed = init_seed
        with paddle.static.program_guard(main, startup):
            x, y, loss = models.build(kind, GLOBAL_BATCH)
            make_optimizer(kind).minimize(loss)
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(startup)
        losses = []
        for bx, by in models.data(kind, GLOBAL_BATCH, steps):
            (lv,) = exe.run(main, feed={"x": bx, "y": by}, fetch_list=[loss])
            losses.append(float(lv))
        scope = paddle.static.global_scope()
        return {
            "params": {n: np.array(scope.find_var(n).get_tensor()) for n in param_names(main)},
            "losses": losses,
        }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    paddle.enable_static()
    fleet.init(is_collective=True)
    rank, nranks = fleet.worker_index(), fleet.worker_num()
    res = {"rank": rank, "nranks": nranks, "runs": {}}
    configs = {
        "mlp_fused": dict(kind="mlp", fuse=True),
        "mlp_fused_num2": dict(kind="mlp", fuse=True, num=2),
        "mlp_unfused": dict(kind="mlp", fuse=False),
        "tfm_fused": dict(kind="tfm", fuse=True),
        "tfm_fused_num3": dict(kind="tfm", fuse=True, num=3),
        "tfm_unfused": dict(kind="tfm", fuse=False),
    }
    for name, cfg in configs.items():
        res["runs"][name] = run_dp(steps=args.steps, rank=rank, nranks=nranks, **cfg)
    if rank == 0:
        res["single"] = {k: run_single(k, args.steps) for k in ("mlp", "tfm")}
    # different models on the two ranks: the layout check must fail on both, not hang
    try:
        run_dp("mlp", 1, rank, nranks, fuse=True, model_kw={"hidden": 32 if rank == 0 else 24})
        res["mismatch"] = None
    except LayoutMismatchError as exc:
        res["mismatch"] = str(exc)
    except Exception:
        res["mismatch"] = "unexpected: " + traceback.format_exc()
    save_result(res)


if __name__ == "__main__":
    main()
