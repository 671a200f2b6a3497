"""The CPU kernels of the MoE ops ERNIE-4.5-MoE calls (custom_ops/moe_cpu_kernels.cc, entered by
paddle_hybrid.dygraph.expert_parallel.moe_kernels), each against a reference computed another way:
NumPy loops over the semantics of Paddle's GPU kernels, or plain Paddle operators and autograd.

Cases: capacity truncation (with and without padding, reverse token drop), an expert that gets no
token, top-k > 1, a rank's part of the experts, a rank that keeps no token; the gradients.  Without
the plugin (or with PADDLE_HYBRID_EXPERT_PARALLEL=off) every op here stops with "The kernel `...` is
not registered".
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest

import paddle_hybrid  # noqa: F401  (installs the kernels)
from paddle import _C_ops

paddle.set_device("cpu")

# The kernels take Paddle 3.3's argument types and are entered on 3.3 only (moe_kernels.VERIFIED_PADDLE); on another
# Paddle (CI's 3.2.2 lane) every test but the last skips, and the last checks that nothing was entered and why.
ON_VERIFIED_PADDLE = paddle.__version__.startswith("3.3.")


@pytest.fixture(autouse=True)
def _verified_paddle_only(request):
    if not ON_VERIFIED_PADDLE and request.node.name != "test_another_paddle_gets_no_kernels_and_is_told_why":
        pytest.skip(f"the MoE CPU kernels are entered on Paddle 3.3 only, this is {paddle.__version__} "
                    "(test_another_paddle_gets_no_kernels_and_is_told_why checks it)")


# --------------------------------------------------------------------------- references


def ref_dispatch(x, w, eid, k, cap, n_experts, use_pad, start, end, reverse):
    """The dispatch as Paddle's GPU kernel documents it, written as loops over experts."""
    S, H = x.shape
    global_counts = np.array([(eid == e).sum() for e in range(n_experts)], dtype=np.int64)
    local_counts = np.zeros(n_experts, dtype=np.int64)
    kept = {}
    for e in range(start, end):
        pairs = [(s, i) for i in range(k) for s in range(S) if eid[s, i] == e]  # slot 0 first, tokens ascending
        if use_pad:
            local_counts[e] = len(pairs)
            pairs = pairs[:cap]
        else:
            pairs = pairs[max(len(pairs) - cap, 0):] if reverse else pairs[:cap]
            local_counts[e] = len(pairs)
        kept[e] = sorted(pairs)
    rows = []  # (token or None for padding, slot)
    for e in range(start, end):
        rows += [(s, i) for s, i in kept[e]]
        if use_pad:
            rows += [(None, None)] * (cap - len(kept[e]))
    y = np.zeros((max(len(rows), 1), H), dtype=x.dtype)
    scatter = np.zeros((k, S), dtype=np.int32)
    cw = np.zeros_like(w)
    rev = np.array([S if s is None else s for s, _ in rows], dtype=np.int32)
    for r, (s, i) in enumerate(rows):
        if s is None:
            continue
        y[r] = x[s]
        scatter[i, s] = r
        cw[s, i] = w[s, i]
    return y, cw, scatter, rev, global_counts, local_counts


def _routing(S, k, n_experts, seed, skip_expert=None):
    rng = np.random.default_rng(seed)
    allowed = [e for e in range(n_experts) if e != skip_expert]
    eid = np.stack([rng.choice(allowed, size=k, replace=False) for _ in range(S)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, size=(S, k)).astype(np.float32)
    return eid, w


DISPATCH_CASES = [
    # (use_pad, start, end, reverse, capacity)
    (True, 0, 4, False, 3),   # padded, every expert here, capacity drops tokens
    (True, 1, 3, False, 3),   # padded, a rank's part of the experts
    (False, 0, 4, False, 3),  # unpadded, capacity drops the last pairs
    (False, 0, 4, True, 3),   # unpadded, reverse token drop keeps the last pairs
    (False, 1, 3, False, 2),
    (True, 0, 4, False, 16),  # no drop
    (False, 0, 4, False, 16),
]


@pytest.mark.parametrize("use_pad, start, end, reverse, capacity", DISPATCH_CASES)
def test_dispatch_forward_and_gradient(use_pad, start, end, reverse, capacity):
    S, H, k, E = 12, 8, 2, 4
    eid, w = _routing(S, k, E, seed=capacity + 10 * start + use_pad, skip_expert=2)  # expert 2 gets no token
    xv = np.random.default_rng(1).standard_normal((S, H)).astype(np.float32)
    x = paddle.to_tensor(xv, stop_gradient=False)
    cw_in = paddle.to_tensor(w, stop_gradient=False)
    y, cw, scatter, rev, counts, local = _C_ops.moe_gate_dispatch_partial_nosoftmaxtopk(
        x, cw_in, paddle.to_tensor(eid), k, capacity, E, use_pad, start, end, reverse)
    ry, rcw, rscatter, rrev, rcounts, rlocal = ref_dispatch(xv, w, eid, k, capacity, E, use_pad, start, end, reverse)
    np.testing.assert_array_equal(y.numpy(), ry)
    np.testing.assert_array_equal(cw.numpy(), rcw)
    np.testing.assert_array_equal(scatter.numpy(), rscatter)
    np.testing.assert_array_equal(rev.numpy(), rrev)
    np.testing.assert_array_equal(counts.numpy(), rcounts)
    np.testing.assert_array_equal(local.numpy(), rlocal)
    assert counts.numpy()[2] == 0 and (eid != 2).all()
    if capacity < 16:
        assert (rcounts > capacity).any()  # the capacity did drop pairs

    # gradient: loss = sum(y * gy) + sum(cw * gcw)
    rng = np.random.default_rng(2)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gcw = rng.standard_normal(w.shape).astype(np.float32)
    ((y * paddle.to_tensor(gy)).sum() + (cw * paddle.to_tensor(gcw)).sum()).backward()
    ref_gx = np.zeros_like(xv)
    for s in range(S):
        for i in range(k):
            if rcw[s, i] > 0:
                ref_gx[s] += gy[rscatter[i, s]]
    np.testing.assert_allclose(x.grad.numpy(), ref_gx, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(cw_in.grad.numpy(), np.where(rcw > 0, gcw, 0))


def test_dispatch_without_padding_where_this_rank_keeps_nothing():
    S, H, k, E = 6, 4, 2, 4
    eid, w = _routing(S, k, E, seed=3, skip_expert=3)
    x = paddle.to_tensor(np.ones((S, H), np.float32))
    y, cw, scatter, rev, counts, local = _C_ops.moe_gate_dispatch_partial_nosoftmaxtopk(
        x, paddle.to_tensor(w), paddle.to_tensor(eid), k, 2, E, False, 3, 4, False)
    assert y.shape == [1, H] and rev.shape == [] and (cw.numpy() == 0).all() and (local.numpy() == 0).all()


def test_dispatch_top1_and_top3():
    for k in (1, 3):
        S, H, E = 9, 4, 5
        eid, w = _routing(S, k, E, seed=k)
        xv = np.arange(S * H, dtype=np.float32).reshape(S, H)
        out = _C_ops.moe_gate_dispatch_partial_nosoftmaxtopk(
            paddle.to_tensor(xv), paddle.to_tensor(w), paddle.to_tensor(eid), k, 2, E, True, 0, E, False)
        ref = ref_dispatch(xv, w, eid, k, 2, E, True, 0, E, False)
        for got, want in zip(out, ref):
            np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_expand_modality_expert_id(dtype):
    eid = np.array([[0, 3], [5, 2], [7, 1]])
    for per_modality, group_size, offset, grouped in [(2, 4, 0, False), (2, 4, 1, False), (0, 4, 0, True),
                                                      (3, 2, 1, True), (0, 0, 0, False)]:
        e = eid + (np.arange(2) * group_size if grouped else 0)
        want = e if per_modality <= 0 else (e // per_modality) * 2 * per_modality + e % per_modality + \
            offset * per_modality
        got = _C_ops.expand_modality_expert_id(paddle.to_tensor(eid.astype(dtype)), per_modality, group_size, offset,
                                               grouped)
        assert got.dtype == getattr(paddle, dtype)
        np.testing.assert_array_equal(got.numpy(), want)


def test_build_src_rank_and_local_expert_id():
    counts = [2, 0, 3, 1, 0, 2]  # experts 1 and 4 get nothing; 2 local experts per rank
    got_rank, got_local = _C_ops.build_src_rank_and_local_expert_id(paddle.to_tensor(counts, dtype="int64"), counts, 2)
    experts = np.repeat(np.arange(len(counts)), counts)
    np.testing.assert_array_equal(got_rank.numpy(), experts // 2)
    np.testing.assert_array_equal(got_local.numpy(), experts % 2)
    assert got_rank.dtype == paddle.int32


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_moe_combine_and_its_gradient_against_autograd(dtype):
    S, k, H = 5, 2, 6
    rng = np.random.default_rng(4)
    rows = rng.permutation(S * k + 2)[:S * k].reshape(S, k).astype(np.int32)  # every pair its own row of x
    xv = rng.standard_normal((S * k + 2, H)).astype(dtype)
    wv = rng.uniform(0.1, 1, (S, k)).astype(dtype)
    wv[1, 1] = 0  # a pair dropped by capacity: weight 0
    gy = rng.standard_normal((S, H)).astype(dtype)
    x, w, idx = paddle.to_tensor(xv), paddle.to_tensor(wv), paddle.to_tensor(rows)
    y = _C_ops.moe_combine(x, w, idx)
    # reference: gather + weighted sum with plain operators, gradients by autograd
    xr, wr = paddle.to_tensor(xv, stop_gradient=False), paddle.to_tensor(wv, stop_gradient=False)
    yr = (paddle.gather(xr, paddle.to_tensor(rows.reshape(-1))).reshape([S, k, H]) * wr.unsqueeze(-1)).sum(1)
    np.testing.assert_allclose(y.numpy(), yr.numpy(), rtol=1e-6, atol=1e-6)
    (yr * paddle.to_tensor(gy)).sum().backward()
    gx, gw_helper = _C_ops.moe_combine_grad(x, w, idx, paddle.to_tensor(gy))
    np.testing.assert_allclose(gx.numpy(), xr.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gw_helper.numpy().reshape(S, k, H).sum(-1), wr.grad.numpy(), rtol=1e-5, atol=1e-5)


def ref_aux_loss(gate_prob, dispatch_mask, tokens_mask, dispatch_tokens_mask, n_experts, use_group, moe_k, clip):
    R, C = gate_prob.shape
    if dispatch_tokens_mask is not None:
        seqlen = float(dispatch_tokens_mask.sum())
    elif tokens_mask is not None:
        seqlen = float(tokens_mask.sum())
    else:
        seqlen = R / n_experts * C
    seqlen = max(seqlen, clip)
    dispatched = dispatch_mask.sum(0) if dispatch_mask.ndim == 2 else dispatch_mask
    ce = dispatched / seqlen
    me = gate_prob.sum(0) / seqlen
    loss = (ce * me).sum() * n_experts
    if use_group:
        loss /= moe_k
    if tokens_mask is not None:
        loss *= seqlen / max(tokens_mask.sum(), clip)
    grad = np.broadcast_to(ce * (1 / moe_k if use_group else 1) * n_experts / seqlen, gate_prob.shape)
    return loss, seqlen, ce, grad


@pytest.mark.parametrize("case", ["counts", "mask_2d", "tokens_mask", "dispatch_tokens_mask", "use_group"])
def test_cal_aux_loss_and_its_gradient(case):
    R, C, n_experts, moe_k = 10, 4, 4, 2
    rng = np.random.default_rng(5)
    gp = rng.uniform(0, 1, (R, C)).astype(np.float32)
    gp /= gp.sum(-1, keepdims=True)
    top = np.argsort(-gp, -1)[:, :moe_k]
    counts = np.bincount(top.reshape(-1), minlength=C).astype(np.int64)
    mask2d = np.zeros((R, C), np.int64)
    np.put_along_axis(mask2d, top, 1, -1)
    dispatch = mask2d if case == "mask_2d" else counts
    tokens_mask = (np.arange(R) % 3 != 0).astype(np.float32) if case == "tokens_mask" else None
    dispatch_tokens_mask = (np.arange(2 * R) % 4 != 0) if case == "dispatch_tokens_mask" else None
    use_group = case == "use_group"
    x = paddle.to_tensor(gp, stop_gradient=False)
    loss, seqlen, ce = _C_ops.cal_aux_loss(
        x, paddle.to_tensor(dispatch), None if tokens_mask is None else paddle.to_tensor(tokens_mask),
        None if dispatch_tokens_mask is None else paddle.to_tensor(dispatch_tokens_mask), n_experts, use_group, moe_k,
        1e-6)
    rloss, rseqlen, rce, rgrad = ref_aux_loss(gp, dispatch, tokens_mask, dispatch_tokens_mask, n_experts, use_group,
                                              moe_k, 1e-6)
    np.testing.assert_allclose(float(loss), rloss, rtol=1e-6)
    np.testing.assert_allclose(float(seqlen), rseqlen, rtol=1e-7)
    np.testing.assert_allclose(ce.numpy(), rce, rtol=1e-6)
    (loss * 3.0).backward()
    np.testing.assert_allclose(x.grad.numpy(), 3.0 * rgrad, rtol=1e-6)
    if case in ("counts", "mask_2d"):  # Paddle's own formula with plain operators (its XPU path) agrees
        from paddle.incubate.nn.functional.cal_aux_loss import math_cal_aux_loss

        mloss, mseqlen, mce = math_cal_aux_loss(paddle.to_tensor(gp), paddle.to_tensor(dispatch), None, None,
                                                n_experts, use_group, moe_k, 1e-6)
        np.testing.assert_allclose(float(loss), float(mloss), rtol=1e-6)
        np.testing.assert_allclose(ce.numpy(), mce.numpy(), rtol=1e-6)


@pytest.mark.parametrize("in_dtype", ["int32", "int64"])
@pytest.mark.parametrize("out_dtype", ["int32", "int64"])
def test_int_bincount(in_dtype, out_dtype):
    from paddle.incubate.nn.functional import int_bincount
    from paddle.incubate.nn.functional.int_bincount import math_int_bincount

    values = np.array([0, 3, 3, 1, 7, 9, 3, 2, 12], dtype=in_dtype)  # 9 and 12 outside [0, 8); 4..6 never
    got = int_bincount(paddle.to_tensor(values), 0, 8, getattr(paddle, out_dtype))
    want = np.bincount(values[values < 8], minlength=8)
    assert got.dtype == getattr(paddle, out_dtype)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(got.numpy(), math_int_bincount(paddle.to_tensor(values.astype("int64")), 0, 8,
                                                                 paddle.int64).numpy())
    shifted = int_bincount(paddle.to_tensor(values), 2, 5, getattr(paddle, out_dtype))
    np.testing.assert_array_equal(shifted.numpy(), want[2:5])


def test_uninstall_removes_the_kernels_and_report_names_them():
    code = textwrap.dedent("""
        import paddle, paddle_hybrid
        from paddle.incubate.nn.functional import expand_modality_expert_id
        e = paddle.to_tensor([[0, 3]])
        assert expand_modality_expert_id(e, 2, 2, 0, False).tolist() == [[0, 5]]
        assert "CPU kernels for 9 MoE ops" in paddle_hybrid.report()
        paddle_hybrid.uninstall()
        try:
            expand_modality_expert_id(e, 2, 2, 0, False)
        except RuntimeError as exc:
            assert "is not registered" in str(exc), exc
        else:
            raise AssertionError("still registered after uninstall()")
        paddle_hybrid.install()
        assert expand_modality_expert_id(e, 2, 2, 0, False).tolist() == [[0, 5]]
        print("OK")
    """)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PADDLE_HYBRID_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_another_paddle_gets_no_kernels_and_is_told_why():
    """On a Paddle the kernels were not written for, none is entered (an op still says it has no kernel) and
    report() names the version; on the verified one, the kernels are there (the tests above)."""
    from paddle.incubate.nn.functional import expand_modality_expert_id

    e = paddle.to_tensor([[0, 3]])
    if ON_VERIFIED_PADDLE:
        assert expand_modality_expert_id(e, 2, 2, 0, False).tolist() == [[0, 5]]
        return
    with pytest.raises(RuntimeError, match="is not registered"):
        expand_modality_expert_id(e, 2, 2, 0, False)
    assert f"no CPU kernels for the MoE ops of PaddleFormers' nn/moe on Paddle {paddle.__version__}" in \
        paddle_hybrid.report()
