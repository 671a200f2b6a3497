"""The buckets wired into fleet, on gloo ranks, against the same training without them
(stock Paddle: the bucket component uninstalled), every rank compared.  The buckets'
collective completes only at ``wait()`` (as NCCL's does), so a reader of gradients that runs
before the sync finished gets wrong numbers.  Tolerances: exact where both paths do the same
arithmetic (scale by 1/2, then a two-rank sum); DataParallel's reducer (the stock side of
``amp`` and ``uninstall``) sums in its own order, atol 1e-6."""
import os

import numpy as np

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))


def _close(got, want, atol, what):
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=atol, err_msg=f"{what} param {k}")


def test_data_parallel_amp_main_grad_and_uninstall():
    results = launch(os.path.join(HERE, "worker_dp.py"), nprocs=2, timeout=300)
    for r in results:
        v = r["variants"]
        for name in ("amp", "main_grad", "uninstall"):
            assert v[name]["buckets"]["bucketed"] and not v[name]["stock"]["bucketed"], name
        # AMP: the inf of rank 1's batch reaches both ranks through the average: both skip step 1
        assert v["amp"]["stock"]["skipped"] == [False, True, False]
        assert v["amp"]["buckets"]["skipped"] == [False, True, False], f"rank {r['rank']}"
        _close(v["amp"]["buckets"]["params"], v["amp"]["stock"]["params"], 0.0, f"rank {r['rank']} amp")
        # main_grad: fp32 main_grad held and synced by the buckets; stock syncs it with
        # fused_allreduce_gradients
        mg = v["main_grad"]["buckets"]
        assert mg["grad_none"] and mg["main_grad_fp32"]
        _close(mg["params"], v["main_grad"]["stock"]["params"], 0.0, f"rank {r['rank']} main_grad")
        # uninstall: reducer back, no bucket code runs, trains as stock
        un = v["uninstall"]["buckets"]
        assert un["restored"] == {"grad_need_sync": True, "no_sync": True, "detached": True}
        assert un["calls_after"] == []
        _close(un["params"], v["uninstall"]["stock"]["params"], 0.0, f"rank {r['rank']} uninstall")
    for name in ("amp", "main_grad", "uninstall"):
        _close(results[1]["variants"][name]["buckets"]["params"], results[0]["variants"][name]["buckets"]["params"],
               0.0, f"{name}: ranks differ")


def test_pipeline_delay_scale_loss_and_scaler():
    results = launch(os.path.join(HERE, "worker_pp.py"), nprocs=4, timeout=400)
    assert sorted((r["dp_rank"], r["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["buckets"]["bucketed"] and not r["stock"]["bucketed"]
        _close(r["buckets"]["params"], r["stock"]["params"], 0.0, f"rank {r['rank']}")
        assert r["buckets"]["losses"] == r["stock"]["losses"]
        st = r["buckets"]["stats"]
        assert st["num_buckets"] > 1 and st["bucket_syncs"] == 3 * st["num_buckets"]
        # microbatches 1-3 show one contribution per parameter: the last one starts every
        # bucket from a hook, during backward
        assert st["started_by_hook"] == st["bucket_syncs"]
