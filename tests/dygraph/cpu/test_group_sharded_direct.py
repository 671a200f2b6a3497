"""Group-sharded stage 2 and stage 3 built directly from their classes on a gloo group (as
Paddle's own ``dygraph_group_sharded_stage2.py`` / ``dygraph_group_sharded_stage3.py`` do), not
through ``group_sharded_parallel``: ``worker_group_sharded.py`` on 2 ranks.

Before the fixes: stage 2's constructor failed on CPU (its ``device`` defaults to "gpu", so
``ParamStorage.add_rank_params`` took the GPU path: "(PreconditionNotMet) Tensor not
initialized yet when DenseTensor::place() is called"), and stage 3 failed the same way at the
first stage 2 built for comparison.  Stage 3 with an optimizer over parameter groups then
trained its sliced parameters on step 1 only (0.03 off stage 2 after 4 steps;
``paddle_hybrid.dygraph.fleet_fixes.stage3_param_groups``).

Tolerances, on every rank: stage 2 against ``paddle.DataParallel`` and stage 3 against stage 2:
rtol 1e-5, atol 1e-7 (Paddle's own tests use rtol 1e-6; seen bitwise equal with MKL's generic
kernels, but MKL's AVX2 kernels, which the plugin selects on AMD CPUs, round a matmul differently
by the alignment of its buffers, and stage 2 keeps gradients in a fused storage: seen 1.8e-8
absolute on values of 1e-3); gradient accumulation over 2
microbatches against one batch: rtol 1e-5, atol 1e-5 (summation order, amplified by Adam where a
gradient is near zero: seen 6.7e-7 with MKL's generic kernels, 2.2e-6 with its AVX2 ones; the
defects these tests guard against are 1e-2 off);
``sync_comm`` and a reload from saved files: exact (same arithmetic).
"""
import os

import numpy as np
import paddle
import pytest

from paddle_hybrid.testing import launch
from paddle_hybrid.testing.launch import LaunchError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_group_sharded.py")
TIMEOUT = 240
STEPS = 4


def _run(variants, env=None):
    return launch(WORKER, nprocs=2, args=["--steps", STEPS, "--variants", ";".join(variants)], timeout=TIMEOUT,
                  env=env)


def _close(got, want, msg, rtol=1e-5, atol=1e-7):
    assert len(got["losses"]) == STEPS, msg
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=rtol, atol=atol, err_msg=msg)
    assert sorted(got["params"]) == sorted(want["params"]) and got["params"], msg
    for k, v in got["params"].items():
        np.testing.assert_allclose(v, want["params"][k], rtol=rtol, atol=atol, err_msg=f"{msg} param {k}")


def _ranks_agree(results, spec):
    """Data parallel and sharding alike end every step with the same parameters on every rank."""
    first = results[0]["variants"][spec]["params"]
    for r in results[1:]:
        for k, v in r["variants"][spec]["params"].items():
            np.testing.assert_array_equal(v, first[k], err_msg=f"rank {r['rank']} {spec} param {k}")


def test_stage2_built_directly_trains_like_data_parallel():
    res = _run(["dp", "s2", "s2_group", "s2_acc", "s2_minimize"])
    for r in res:
        v, msg = r["variants"], f"rank {r['rank']}"
        assert v["s2"]["model_class"] == "GroupShardedStage2", msg
        assert v["dp"]["losses"][0] != v["dp"]["losses"][-1], msg  # it trains
        _close(v["s2"], v["dp"], f"{msg} s2 vs dp")
        _close(v["s2_group"], v["dp"], f"{msg} s2 (parameter group) vs dp")
        _close(v["s2_acc"], v["s2"], f"{msg} s2 accumulating vs s2", rtol=1e-5, atol=1e-5)
        # Paddle's stage 2 optimizer only supports step(); minimize() says so
        assert v["s2_minimize"]["minimize_error"] == ("RuntimeError: optimizer.minimize() not support now, "
                                                      "please use optimizer.step()"), msg
    for spec in ("dp", "s2", "s2_group", "s2_acc"):
        _ranks_agree(res, spec)


# Paddle 3.2.2: stage 3 with a layer used twice and the middle Linear excluded by id stops in
# backward ("Tensor '' used in gradient computation has been modified by an inplace operation");
# Paddle 3.3 trains it.  Not investigated: the case is asserted to fail there (below), so a Paddle
# or plugin change that fixes or moves it is seen.
EXCLUDE_BY_ID_RUNS = not paddle.__version__.startswith("3.2.")


@pytest.mark.skipif(EXCLUDE_BY_ID_RUNS, reason="Paddle 3.3 trains this case; "
                    "test_stage3_built_directly_trains_like_stage2 compares it with stage 2")
def test_stage3_exclude_by_id_with_a_shared_layer_on_paddle_32():
    with pytest.raises(LaunchError, match="modified by an inplace operation"):
        _run(["sp_s3_id"])


def test_stage3_built_directly_trains_like_stage2():
    by_id = ["sp_s3_id"] if EXCLUDE_BY_ID_RUNS else []
    res = _run(["s2", "s3", "s3_group", "s3_acc", "s3_sync", "s3_save", "sp_s2", "sp_s3_name"] + by_id)
    for r in res:
        v, msg = r["variants"], f"rank {r['rank']}"
        assert v["s3"]["model_class"] == "GroupShardedStage3", msg
        assert v["s3"]["sliced"] == [2], msg  # the hidden weight (184 x 184 > 2**15); the rest whole
        _close(v["s3"], v["s2"], f"{msg} s3 vs s2")
        _close(v["s3_group"], v["s2"], f"{msg} s3 (parameter group) vs s2")
        _close(v["s3_acc"], v["s2"], f"{msg} s3 accumulating (parameter group) vs s2", rtol=1e-5, atol=1e-5)
        _close(v["s3_sync"], v["s3"], f"{msg} s3 sync_comm vs s3", rtol=0)
        # a layer used twice, GroupNorm excluded by class name; the middle Linear excluded by id
        assert v["sp_s3_name"]["sliced"] == [2, 3], msg  # the shared and the middle weight
        _close(v["sp_s3_name"], v["sp_s2"], f"{msg} shared layer, exclude by name, vs s2")
        if by_id:
            assert v["sp_s3_id"]["sliced"] == [2], msg       # the middle one kept whole
            _close(v["sp_s3_id"], v["sp_s2"], f"{msg} shared layer, exclude by id, vs s2")
        _check_reload(v["s3_save"], v["s3"], msg)
    for spec in ["s3", "s3_group", "s3_acc", "sp_s3_name"] + by_id:
        _ranks_agree(res, spec)


def _check_reload(v, trained, msg):
    """Saved after training, loaded into a fresh model: the same values, and the same further
    training as the model that was saved."""
    _close(v, trained, f"{msg} s3_save before saving", rtol=0)
    rl = v["reload"]
    for k, val in v["params"].items():
        np.testing.assert_array_equal(rl["loaded_params"][k], val, err_msg=f"{msg} loaded {k}")
        np.testing.assert_array_equal(rl["params"][k], rl["cont_params"][k], err_msg=f"{msg} reloaded run {k}")
    assert rl["losses"] == rl["cont_losses"], msg
    assert any(not np.array_equal(rl["cont_params"][k], v["params"][k]) for k in v["params"]), msg  # it trained on


def test_stage3_parameter_groups_wrong_without_the_fleet_fix():
    """The fleet fix is what makes stage 3 with parameter groups right: with fleet fixes off
    (``PADDLE_HYBRID_FLEET_FIXES=0``) its sliced weight stops training after step 1 (seen 0.03
    off stage 2 after 4 steps)."""
    res = _run(["s2", "s3_group"], env={"PADDLE_HYBRID_FLEET_FIXES": "0"})
    for r in res:
        v = r["variants"]
        assert np.abs(v["s3_group"]["params"][2] - v["s2"]["params"][2]).max() > 1e-3, r["rank"]
        # step 1's update is right (the loss after it, step 2's, is still stage 2's)
        assert v["s3_group"]["losses"][:2] == v["s2"]["losses"][:2], r["rank"]
