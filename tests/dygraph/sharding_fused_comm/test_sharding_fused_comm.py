"""Sharding stage 1 on gloo with one reduce and one broadcast per owning rank
(``paddle_hybrid.dygraph.sharding_fused_comm``), against Paddle's per-parameter calls
(``PADDLE_HYBRID_SHARDING_FUSED_COMM=off``) and against one process.

The model is ``tests/dygraph/cpu/worker_sharding.py``'s MLP (4 blocks: 8 parameters), 5 steps,
Adam and SGD with global-norm clipping.  On 2 ranks the fused run is bitwise equal to Paddle's
calls on every rank (one sum of two parts, one copy).  On 3 ranks (sharding 3, sizes that do not
divide) both are compared with one process at the sharding tests' tolerance (rtol = atol = 1e-5:
gloo may order the three parts of a sum differently in a longer buffer).  The number of calls is
what makes it faster: per step one reduce and one broadcast for each rank that owns a parameter,
against one per parameter."""
import os
import types

import numpy as np
import pytest

from paddle_hybrid.dygraph import sharding_fused_comm
from paddle_hybrid.registry import device
from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu", "worker_sharding.py")
VARIANTS = ["v1", "v1+clip"]
STEPS = 5
RTOL = ATOL = 1e-5


def _run(nprocs, fused, *args):
    return launch(WORKER, nprocs=nprocs, timeout=240,
                  args=["--sharding", str(nprocs), "--steps", str(STEPS), "--variants", ";".join(VARIANTS), *args],
                  env={"PADDLE_HYBRID_SHARDING_FUSED_COMM": "auto" if fused else "off"})



def test_two_ranks_bitwise_equal_to_per_parameter_calls_with_one_call_per_owner():
    fused, plain = _run(2, True), _run(2, False)
    for got, want in zip(fused, plain):
        assert got["rank"] == want["rank"]
        for spec in VARIANTS:
            a, b = got["variants"][spec], want["variants"][spec]
            np.testing.assert_array_equal(a["losses"], b["losses"], err_msg=f"rank {got['rank']} {spec}")
            assert a["params"].keys() == b["params"].keys()
            for name in a["params"]:
                np.testing.assert_array_equal(a["params"][name], b["params"][name],
                                              err_msg=f"rank {got['rank']} {spec} {name}")
        assert want["fused_calls"] == {"reduce": 0, "broadcast": 0}
        # both ranks own parameters: one reduce and one broadcast per owner, per step, per variant
        assert got["fused_calls"] == {"reduce": 2 * STEPS * len(VARIANTS), "broadcast": 2 * STEPS * len(VARIANTS)}


def test_three_ranks_uneven_like_one_process():
    results = _run(3, True, "--layers", "3", "--hidden", "10")
    for r in results:
        for spec in VARIANTS:
            v = r["variants"][spec]
            msg = f"rank {r['rank']} {spec}"
            np.testing.assert_allclose(v["losses"], v["ref_losses"], rtol=RTOL, atol=ATOL, err_msg=msg)
            for name, got in v["params"].items():
                np.testing.assert_allclose(got, v["ref_params"][name], rtol=0, atol=ATOL, err_msg=f"{msg} {name}")
        assert 0 < r["fused_calls"]["reduce"] <= 3 * STEPS * len(VARIANTS), r["fused_calls"]
        assert r["fused_calls"]["reduce"] == r["fused_calls"]["broadcast"]


def test_xpu_cluster_parallel_follows_the_device_registrys_answer(monkeypatch):
    """XPU's cluster-parallel sync (``XPU_CDNN_CLUSTER_PARALLEL``) is left to Paddle on an XPU build
    only; whether this is one is :func:`paddle_hybrid.registry.device.xpu_build`'s answer, faked here
    (the component used to ask Paddle itself, and a faked answer changed nothing)."""
    optimizer = types.SimpleNamespace(comm_overlap=False, tensor_fusion=False)
    gloo_group = types.SimpleNamespace(process_group=type("ProcessGroupGloo", (), {})())
    monkeypatch.setenv("XPU_CDNN_CLUSTER_PARALLEL", "1")
    assert not sharding_fused_comm._paddle_path_only(optimizer, gloo_group)  # this CPU build: the fused path
    monkeypatch.setattr(device, "xpu_build", lambda: True)
    assert sharding_fused_comm._paddle_path_only(optimizer, gloo_group)
    monkeypatch.delenv("XPU_CDNN_CLUSTER_PARALLEL")
    assert not sharding_fused_comm._paddle_path_only(optimizer, gloo_group)  # without the setting: fused on any build
