"""Static data parallel on 2 gloo ranks through fleet + the plugin's fused all_reduce.

One launch (``worker_train.py``) runs every configuration; each test checks one
property of the collected results.

Tolerances: fused vs unfused and rank vs rank are compared exactly (with two
ranks the reduction a+b has the same summation order either way).  Against
one process on the full batch the order of the batch reduction differs, so
parameters are compared with atol 1e-6 (float32, 5 steps).
"""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 5


@pytest.fixture(scope="module")
def results():
    return launch(os.path.join(HERE, "worker_train.py"), nprocs=2, args=["--steps", str(STEPS)], timeout=300)


def _equal(a, b):
    assert a.keys() == b.keys()
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


def test_plugin_meta_optimizer_is_applied(results):
    # fleet chains it outermost around RawProgramOptimizer, whose transpilation it
    # replaces (the all_reduce counts in test_allreduce_counts show Raw added none)
    for r in results:
        for name, run in r["runs"].items():
            assert run["applied"][0] == "FusedAllreduceOptimizer", (name, run["applied"])
            assert set(run["applied"]) <= {"FusedAllreduceOptimizer", "RawProgramOptimizer"}


def test_allreduce_counts(results):
    runs = results[0]["runs"]
    # MLP: 6 grads (216 floats) -> one group at the default 8 per group; 2 per group -> 3
    assert (runs["mlp_fused"]["num_allreduce"], runs["mlp_fused"]["num_coalesce"]) == (1, 1)
    assert runs["mlp_fused_num2"]["num_allreduce"] == 3
    assert (runs["mlp_unfused"]["num_allreduce"], runs["mlp_unfused"]["num_coalesce"]) == (6, 0)
    # transformer block: 12 grads -> 8 + 4; 3 per group -> 4; unfused -> 12
    assert [len(g[1]) for g in runs["tfm_fused"]["groups"]] == [8, 4]
    assert runs["tfm_fused_num3"]["num_allreduce"] == 4
    assert runs["tfm_unfused"]["num_allreduce"] == 12


def test_parameters_broadcast_from_rank0(results):
    # ranks initialise with different seeds; the startup broadcast makes them equal
    for name in results[0]["runs"]:
        _equal(results[0]["runs"][name]["init"], results[1]["runs"][name]["init"])


@pytest.mark.parametrize("name", ["mlp_fused", "mlp_fused_num2", "mlp_unfused", "tfm_fused", "tfm_fused_num3", "tfm_unfused"])
def test_parameters_equal_on_every_rank(results, name):
    _equal(results[0]["runs"][name]["params"], results[1]["runs"][name]["params"])
    assert results[0]["runs"][name]["fingerprint"] == results[1]["runs"][name]["fingerprint"]


@pytest.mark.parametrize("kind", ["mlp", "tfm"])
def test_fused_equals_unfused_exactly(results, kind):
    for r in results:
        base = r["runs"][f"{kind}_unfused"]
        for variant in (f"{kind}_fused", f"{kind}_fused_num" + ("2" if kind == "mlp" else "3")):
            _equal(r["runs"][variant]["params"], base["params"])
            assert r["runs"][variant]["losses"] == base["losses"]
        # training moved the parameters (the comparison is not between untouched values)
        assert any(not np.array_equal(base["params"][n], base["init"][n]) for n in base["params"])


@pytest.mark.parametrize("kind", ["mlp", "tfm"])
def test_matches_one_process_on_full_batch(results, kind):
    single = results[0]["single"][kind]
    dp = results[0]["runs"][f"{kind}_fused"]
    for n, want in single["params"].items():
        np.testing.assert_allclose(dp["params"][n], want, rtol=0, atol=1e-6, err_msg=n)
    # the full-batch loss is the mean of the two half-batch losses
    mean_loss = (np.array(results[0]["runs"][f"{kind}_fused"]["losses"]) + np.array(results[1]["runs"][f"{kind}_fused"]["losses"])) / 2
    np.testing.assert_allclose(mean_loss, single["losses"], rtol=1e-6)


def test_layout_mismatch_names_first_differing_gradient(results):
    for r in results:
        msg = r["mismatch"]
        assert msg is not None and not msg.startswith("unexpected"), msg
        assert "linear_2.w_0@GRAD" in msg and "[32, 4]" in msg and "[24, 4]" in msg, msg
