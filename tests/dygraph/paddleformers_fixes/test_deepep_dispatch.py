"""DeepEP's dispatch and combine on gloo (``paddle_hybrid.common.deepep_gloo``), as
PaddleFormers 1.2 reaches them where DeepEP is absent (``token_dispatcher.fused_dispatch`` /
``fused_combine``, set by ``paddleformers_fixes.deepep_standin``), on 2 gloo ranks
(``worker_deepep_dispatch.py``), against numpy on both ranks' data:

* the dispatch: rank ``r`` receives, in DeepEP's order (source rank, then the token's row), each
  token that chose at least one of ``r``'s experts, once, with its top-k positions as ``r``'s local
  expert ids (-1 for another rank's expert or none) and weights (0 there), and per local expert the
  number of received tokens that chose it (exactly); top-2, a token on both ranks, a token with both
  experts on one rank, a top-k position -1 (``masked``), an expert with no token, and a rank that
  receives no token (``one_rank``);
* combine(experts(dispatch(x))) with each expert a linear map: every token's output equals the
  mixture ``sum_k w_k x W[e_k]`` (rtol 1e-5), and the gradients of the tokens, of the weights and of
  every expert equal the one-process gradient of that mixture (numpy; rtol 1e-5, atol 1e-6);
* PaddleFormers' own ``MoEFlexTokenDispatcher`` (DeepSeek-V3's Flex layer drives it) on top of them:
  the same mixture and gradients of the input, of the dense routing probabilities and of the experts,
  also on the rank that receives no token.

Seen failing first: without the plugin's stand-in ``token_dispatcher.fused_dispatch`` is None
(``TypeError: 'NoneType' object is not callable``) and ``MoEFlexTokenDispatcher`` raises
``ImportError: DeepEP is not supported in your paddlepaddle whl package.`` (all 5 tests).  Measured: the
mixture and its gradients within 1.8e-7 of numpy (relative to each tensor's largest element); ~6 s.
"""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch
from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture: skip / fail / ok)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_deepep_dispatch.py")
E, K, H, RANKS = 4, 2, 3, 2
PER_RANK = E // RANKS
TOL = dict(rtol=1e-5, atol=1e-6)


def _experts():
    return np.random.default_rng(7).normal(size=(E, H, H)).astype("float32")


def _expected_dispatch(data, me):
    """What rank ``me`` must receive: (rows, local ids, weights, tokens per local expert)."""
    rows, local, weights = [], [], []
    for p in range(RANKS):
        x, idx, w = data[p]["x"], data[p]["idx"], data[p]["w"]
        for t in range(len(x)):
            mine = (idx[t] >= 0) & (idx[t] // PER_RANK == me)
            if mine.any():
                rows.append(x[t])
                local.append(np.where(mine, idx[t] - me * PER_RANK, -1))
                weights.append(np.where(mine, w[t], 0.0))
    counts = [int(sum((row == e).sum() for row in local)) for e in range(PER_RANK)]
    return (np.array(rows, "float32").reshape(-1, H), np.array(local, "int64").reshape(-1, K),
            np.array(weights, "float32").reshape(-1, K), counts)


def _mixture(data, experts):
    """One process: outputs, and gradients of x, w and every expert, of sum(out * G) (numpy)."""
    out, gx, gw, ge = {}, {}, {}, np.zeros_like(experts)
    for p in range(RANKS):
        x, idx, w, g = data[p]["x"], data[p]["idx"], data[p]["w"], data[p]["grad_out"]
        o, dx, dw = np.zeros_like(x), np.zeros_like(x), np.zeros_like(w)
        for t in range(len(x)):
            for k in range(K):
                e = idx[t, k]
                if e < 0:
                    continue
                o[t] += w[t, k] * x[t] @ experts[e]
                dx[t] += w[t, k] * experts[e] @ g[t]
                dw[t, k] = (x[t] @ experts[e]) @ g[t]
                ge[e] += w[t, k] * np.outer(x[t], g[t])
        out[p], gx[p], gw[p] = o, dx, dw
    return out, gx, gw, ge


@pytest.fixture(scope="module")
def results(paddleformers_version):
    return launch(WORKER, nprocs=RANKS, env={"OMP_NUM_THREADS": "1"}, timeout=240)


@pytest.mark.parametrize("case", ["spread", "masked", "one_rank"])
def test_dispatch_combine_against_numpy(results, case):
    data = {r["rank"]: r["fused"][case] for r in results}
    assert all("error" not in v for v in data.values()), [v.get("error") for v in data.values()]
    experts = _experts()
    out, gx, gw, ge = _mixture(data, experts)
    received = [len(data[r]["recv_x"]) for r in range(RANKS)]
    if case in ("spread", "masked"):
        idx = np.concatenate([data[r]["idx"] for r in range(RANKS)])
        assert (idx == -1).any() == (case == "masked") and not (idx == 3).any(), idx  # expert 3 idle
        assert received[0] and received[1], received
        both = [(row[row >= 0] // PER_RANK) for row in idx]
        assert any(len(set(b)) == 2 for b in both) and any(len(b) == 2 and len(set(b)) == 1 for b in both)
    else:
        assert received[1] == 0, received  # rank 1 receives no token
    for me in range(RANKS):
        got, where = data[me], f"{case}, rank {me}"
        assert results[me]["fused_dispatch"].endswith("deepep_standin.fused_dispatch"), results[me]["fused_dispatch"]
        rows, local, weights, counts = _expected_dispatch(data, me)
        np.testing.assert_array_equal(got["recv_x"], rows, err_msg=where)
        np.testing.assert_array_equal(got["recv_idx"], local, err_msg=where)
        np.testing.assert_array_equal(got["recv_w"], weights, err_msg=where)
        assert got["tokens_per_expert"] == counts, (where, got["tokens_per_expert"], counts)
        np.testing.assert_allclose(got["out"], out[me], **TOL, err_msg=f"{where}: output")
        np.testing.assert_allclose(got["grad_x"], gx[me], **TOL, err_msg=f"{where}: gradient of x")
        np.testing.assert_allclose(got["grad_w"], gw[me], **TOL, err_msg=f"{where}: gradient of the weights")
        for e, grad in got["grad_experts"].items():
            np.testing.assert_allclose(grad, ge[e], **TOL, err_msg=f"{where}: gradient of expert {e}")
    if case == "one_rank":
        assert not ge[2].any() and not ge[3].any()


@pytest.mark.parametrize("case", ["spread", "one_rank"])
def test_paddleformers_flex_dispatcher_on_gloo(results, case):
    data = {r["rank"]: r["fused"][case] for r in results}
    flex = {r["rank"]: r["dispatcher"][case] for r in results}
    assert all("error" not in v for v in flex.values()), [v.get("error") for v in flex.values()]
    experts = _experts()
    out, gx, gw, ge = _mixture(data, experts)
    for me in range(RANKS):
        got, where = flex[me], f"MoEFlexTokenDispatcher {case}, rank {me}"
        np.testing.assert_allclose(got["out"], out[me], **TOL, err_msg=f"{where}: output")
        np.testing.assert_allclose(got["grad_x"], gx[me], **TOL, err_msg=f"{where}: gradient of x")
        dense = np.zeros((len(gw[me]), E), "float32")
        for t, row in enumerate(data[me]["idx"]):
            for k, e in enumerate(row):
                dense[t, e] = gw[me][t, k]
        np.testing.assert_allclose(got["grad_probs"], dense, **TOL, err_msg=f"{where}: gradient of the probs")
        for e, grad in got["grad_experts"].items():
            np.testing.assert_allclose(grad, ge[e], **TOL, err_msg=f"{where}: gradient of expert {e}")
