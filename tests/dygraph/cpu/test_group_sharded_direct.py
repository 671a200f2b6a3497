"""Group-sharded stage 2 and stage 3 built directly from their classes on a gloo group (as
Paddle's own ``dygraph_group_sharded_stage2.py`` / ``dygraph_group_sharded_stage3.py`` do), not
through ``group_sharded_parallel``: ``worker_group_sharded.py`` on 2 ranks.

Before the fixes: stage 2's constructor failed on CPU (its ``device`` defaults to "gpu", so
``ParamStorage.add_rank_params`` took the GPU path: "(PreconditionNotMet) Tensor not
initialized yet when DenseTensor::place() is called"), and stage 3 failed the same way at the
first stage 2 built for comparison.  Stage 3 with an optimizer over parameter groups then
trained its sliced parameters on step 1 only (0.03 off stage 2 after 4 steps;
``paddle_hybrid.dygraph.fleet_fixes.stage3_param_groups``).

What the layouts compute differently, and so how they are compared:

- **Without gradient clipping they do the same arithmetic**: the same matmuls on the same
  values, each gradient summed over the 2 ranks by one all_reduce (a + b, either order) and
  scaled by 1/2 (exact).  Stage 2 against ``paddle.DataParallel`` and stage 3 (every form but
  accumulation) against stage 2 are compared **bitwise** there
  (``test_without_clipping_the_layouts_do_one_arithmetic``), on any CPU and MKL code path.
- **With ``ClipGradByGlobalNorm`` they sum the same squares in another order**: DataParallel
  sums every parameter's on every rank; stage 2 each rank its own parameters, then an
  all_reduce; stage 3 the sliced parameters' slices, all-reduced, then the whole ones added
  (``GroupShardedClipGrad``).  fp32 reassociation of these <= 9 terms moves the norm, and with
  it the clip coefficient, by at most ~9 x 2**-24 relative (seen: 1.3e-7 at step 1, stage 3
  with a layer excluded by id against stage 2).  Adam's first update is nearly scale-free, so
  step 1 differs by at most 2 ULPs of a parameter (seen 1.5e-8); the later steps compute
  gradients from those parameters, and where an element's gradient is near zero its Adam update
  (m / sqrt(v)) can change by a large part of itself.  Seen after 4 steps: 1.1e-6 (MKL's
  AVX-512 kernels, stage 3 excluded by id against stage 2) and 7.9e-7 (its AVX2 kernels, stage 2
  against DataParallel); other pairs are bitwise equal on one code path and not on another,
  depending only on whether the rounding of the two sums happens to agree.  The tolerance
  ``REORDERED_NORM`` (atol 1e-5: a thousandth of a step's update at lr 0.01, 10x the largest
  seen) separates that from the defects these tests guard against, which are >= 1e-3 off after
  4 steps (a sliced parameter that stops training: 3e-2; a clip coefficient applied to some
  parameters only: 7 % of a step, 7e-4 per step).  It used to be rtol 1e-5 / atol 1e-7,
  attributed to how MKL's AVX2 kernels round by buffer alignment; with clipping off every pair
  is bitwise equal on AVX2 and AVX-512 alike, so the difference was the norm's order all along.
- Gradient accumulation over 2 microbatches against one batch sums each gradient in another
  order inside the matmul (two halves, then added): the same Adam amplification, with or
  without clipping, the same tolerance (seen 6.7e-7 with MKL's generic kernels, 2.2e-6 with its
  AVX2 ones).
- ``sync_comm`` and a reload from saved files: exact (same arithmetic).
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


# the same squares of the global norm summed in another order, amplified by Adam (docstring)
REORDERED_NORM = dict(rtol=1e-5, atol=1e-5)


def _run(variants, env=None, clip=1.0):
    return launch(WORKER, nprocs=2, args=["--steps", STEPS, "--variants", ";".join(variants), "--clip", clip],
                  timeout=TIMEOUT, env=env)


def _close(got, want, msg, rtol, atol):
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
        _close(v["s2"], v["dp"], f"{msg} s2 vs dp", **REORDERED_NORM)
        _close(v["s2_group"], v["dp"], f"{msg} s2 (parameter group) vs dp", **REORDERED_NORM)
        _close(v["s2_acc"], v["s2"], f"{msg} s2 accumulating vs s2", **REORDERED_NORM)
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
        _close(v["s3"], v["s2"], f"{msg} s3 vs s2", **REORDERED_NORM)
        _close(v["s3_group"], v["s2"], f"{msg} s3 (parameter group) vs s2", **REORDERED_NORM)
        _close(v["s3_acc"], v["s2"], f"{msg} s3 accumulating (parameter group) vs s2", **REORDERED_NORM)
        _close(v["s3_sync"], v["s3"], f"{msg} s3 sync_comm vs s3", rtol=0, atol=0)
        # a layer used twice, GroupNorm excluded by class name; the middle Linear excluded by id
        assert v["sp_s3_name"]["sliced"] == [2, 3], msg  # the shared and the middle weight
        _close(v["sp_s3_name"], v["sp_s2"], f"{msg} shared layer, exclude by name, vs s2", **REORDERED_NORM)
        if by_id:
            assert v["sp_s3_id"]["sliced"] == [2], msg       # the middle one kept whole
            _close(v["sp_s3_id"], v["sp_s2"], f"{msg} shared layer, exclude by id, vs s2", **REORDERED_NORM)
        _check_reload(v["s3_save"], v["s3"], msg)
    for spec in ["s3", "s3_group", "s3_acc", "sp_s3_name"] + by_id:
        _ranks_agree(res, spec)


def _equal(got, want, msg):
    assert got["losses"] == want["losses"], msg
    assert sorted(got["params"]) == sorted(want["params"]) and got["params"], msg
    for k, v in got["params"].items():
        np.testing.assert_array_equal(v, want["params"][k], err_msg=f"{msg} param {k}")


def test_without_clipping_the_layouts_do_one_arithmetic():
    """No gradient clipping: stage 2 against DataParallel and stage 3 (sliced or excluded by
    class name or id, a shared layer, parameter groups) against stage 2, bitwise, on every rank
    (see the module docstring: with clipping the global norm is summed in another order)."""
    by_id = ["sp_s3_id"] if EXCLUDE_BY_ID_RUNS else []
    res = _run(["dp", "s2", "s2_group", "s3", "s3_group", "sp_s2", "sp_s3_name"] + by_id, clip=0)
    pairs = [("s2", "dp"), ("s2_group", "dp"), ("s3", "s2"), ("s3_group", "s2"), ("sp_s3_name", "sp_s2")]
    pairs += [("sp_s3_id", "sp_s2")] if by_id else []
    for r in res:
        v = r["variants"]
        assert v["dp"]["losses"][0] != v["dp"]["losses"][-1], r["rank"]  # it trains
        for got, want in pairs:
            _equal(v[got], v[want], f"rank {r['rank']} {got} vs {want}, no clipping")


def _check_reload(v, trained, msg):
    """Saved after training, loaded into a fresh model: the same values, and the same further
    training as the model that was saved."""
    _close(v, trained, f"{msg} s3_save before saving", rtol=0, atol=0)
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
