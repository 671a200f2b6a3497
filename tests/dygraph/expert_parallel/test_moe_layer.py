"""Paddle's ``MoELayer`` with experts spread over gloo ranks equals one process holding every
expert (``worker_moe.py`` builds both in each rank and compares on that rank): output, loss,
input gradient, gate gradient and the gradients of the experts the rank holds.

Gates: naive top-2, gshard (top-2, random routing) and switch (top-1, random noise), the
random ones with the same ``paddle.seed`` before each rank's forward in both runs, so the
comparison is exact in what it routes.  Their capacity factor is set high enough that no token
is dropped: capacity is counted per expert over the whole EP group in the distributed run and
over one batch in the reference, so with drops the two legitimately differ (the capacity rule
itself is checked kernel by kernel in ``test_routing_kernels.py``).

Tolerance: rtol 1e-5, atol 1e-5.  The arithmetic is the same, but an expert multiplies its
tokens in another order (all ranks' tokens at once against one batch at a time), which moves
float32 sums by an ulp or so (seen: at most 6e-6 absolute on gradients of magnitude up to 56).
"""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = dict(rtol=1e-5, atol=1e-5)


def check_like_one_process(results, *, input_grad=True):
    for rank, got in enumerate(results):
        ref = got["reference"]
        where = f"rank {rank}"
        np.testing.assert_allclose(got["loss"], ref["loss"], **TOL, err_msg=where)
        np.testing.assert_allclose(got["out"], ref["out"], **TOL, err_msg=where)
        if input_grad:
            np.testing.assert_allclose(got["x_grad"], ref["x_grad"], **TOL, err_msg=where)
        for name, value in ref["gate"].items():
            np.testing.assert_allclose(got["gate"][name], value, **TOL, err_msg=f"{where} gate {name}")
        for name, (mine, want) in got["experts"].items():
            np.testing.assert_allclose(mine, want, **TOL, err_msg=f"{where} expert {name}")


@pytest.mark.parametrize("flags", [
    ["--gate", "gshard"],
    ["--gate", "switch"],
    ["--fleet", "--recompute"],  # fleet's EP group (ep_degree 2 beside mp 2), recompute inside each expert
], ids=["gshard", "switch", "fleet-ep-recompute"])
def test_ep2_equals_one_process(flags):
    check_like_one_process(launch(os.path.join(HERE, "worker_moe.py"), nprocs=2, args=flags, timeout=240))


def test_top2_input_gradient_sums_both_routes():
    """The input gradient of top-2 routing needs both routes of a token.  The one-process
    ``MoELayer`` shares Paddle's ``MoEScatter``, so here the reference is the same MoE written
    densely with plain ops (every expert on every token, top-2 picked and weighted).  Seen:
    with PADDLE_HYBRID_FLEET_FIXES=0 (Paddle's ``scatter(overwrite=True)``, one route kept) both
    the distributed and the one-process layer miss it."""
    results = launch(os.path.join(HERE, "worker_moe.py"), nprocs=2, args=["--gate", "naive", "--topk", "2"],
                     timeout=240)
    check_like_one_process(results)
    for rank, got in enumerate(results):
        dense = got["reference"]["dense_x_grad"]
        assert np.abs(dense).max() > 0
        np.testing.assert_allclose(got["x_grad"], dense, **TOL, err_msg=f"rank {rank}")
        np.testing.assert_allclose(got["reference"]["x_grad"], dense, **TOL, err_msg=f"rank {rank}, one process")


@pytest.mark.parametrize("flags", [["--experts", "1"], ["--dp", "2"]], ids=["ep4", "ep2xdp2"])
def test_four_ranks_equal_one_process(flags):
    """EP=4 (one expert a rank) and EP=2 x DP=2 (expert gradients all-reduced over the replicas,
    as a data-parallel job does): every rank equals one process holding all experts and, for
    DP, all four batches."""
    check_like_one_process(launch(os.path.join(HERE, "worker_moe.py"), nprocs=4, args=flags, timeout=300))


def test_rank_without_tokens_and_input_without_gradient_does_not_hang():
    """Rank 1's experts get no token (the gate's bias) and the input needs no gradient: rank 1
    must still post the backward collective, or rank 0 waits for it forever (seen: with
    PADDLE_HYBRID_FLEET_FIXES=0 the launch times out).  Values equal one process."""
    results = launch(os.path.join(HERE, "worker_moe.py"), nprocs=2, args=["--starve-rank", "1"], timeout=120)
    check_like_one_process(results, input_grad=False)
    assert results[1]["tokens_to_my_experts"] == 0 and results[0]["tokens_to_my_experts"] > 0
