"""Every reader of gradients sees finished, averaged buckets (issue "Safe where it cannot be
run", AMP).

On NCCL a bucket's all_reduce runs on its own stream; reading the buffer before the task's
wait() reads the local gradient (scaled by 1/nranks), and writing it is overwritten when the
reduction lands.  ``GradScaler.step``/``minimize`` unscale and check for inf/nan *before* the
optimizer's ``step()``, where fleet finished the sync.  The collective here completes only at
``wait()`` (``bucket_fakes.DelayedAllReduce``), so a reader that runs too early gets wrong
numbers; one process plays both ranks (``FakeGroup``).  References: the same model without
buckets, its gradients replaced by the exact average the two ranks would compute; equal
bitwise (the averaging is the same two float operations).
"""
import numpy as np
import pytest

import paddle

import paddle_hybrid
from bucket_fakes import FakeGroup, SyncingOptimizer, cpu_grad_scaler, delayed_all_reduce


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 16),
                                paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _batch(step):
    rng = np.random.default_rng(step)
    return (paddle.to_tensor(rng.standard_normal((6, 8)).astype("float32")),
            paddle.to_tensor(rng.standard_normal((6, 4)).astype("float32")))


def _average_like_two_ranks(params, group):
    """What the bucket all_reduce computes from each parameter's local gradient g:
    g/2 + other(g/2)."""
    with paddle.no_grad():
        for p in params:
            half = p.grad * 0.5
            p.grad.copy_(half + group.other(half), False)


def test_gradients_are_averaged_when_backward_returns():
    group = FakeGroup()  # the other rank's gradient differs from ours
    m, ref = _model(), _model()
    with delayed_all_reduce() as fake:
        gb = paddle_hybrid.GradBuckets(m.parameters(), group=group, bucket_size_mb=0.001, check_layout=False)
        try:
            x, y = _batch(0)
            paddle.nn.functional.mse_loss(m(x), y).backward()
            paddle.nn.functional.mse_loss(ref(x), y).backward()
            _average_like_two_ranks(ref.parameters(), group)
            assert fake.calls, "the buckets issued no all_reduce"
            # any reader right after backward: fused_allreduce_gradients, clipping, a scaler
            for p, q in zip(m.parameters(), ref.parameters()):
                np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=p.name)
        finally:
            gb.remove()


@pytest.mark.parametrize("use_minimize", [False, True])
def test_grad_scaler_unscales_and_checks_finished_buckets(use_minimize):
    """Loss scale 1024, global-norm clipping (5.0: above the true norm, so only a gradient
    left scaled is clipped), SGD.  At step 1 the other rank sends an inf: the averaged
    gradient is inf and the scaler must skip that update."""
    group = FakeGroup()
    replicas = group.other  # the other rank's gradient differs from ours
    m, ref = _model(), _model()
    clip = paddle.nn.ClipGradByGlobalNorm(5.0)  # above the true norm: only a wrong scale clips
    ref_opt = paddle.optimizer.SGD(0.1, parameters=ref.parameters(), grad_clip=clip)
    ref_scaler, scaler = cpu_grad_scaler(), cpu_grad_scaler()
    with delayed_all_reduce():
        gb = paddle_hybrid.GradBuckets(m.parameters(), group=group, bucket_size_mb=0.001, check_layout=False)
        opt = SyncingOptimizer(paddle.optimizer.SGD(0.1, parameters=m.parameters(), grad_clip=clip), gb)
        try:
            for step in range(3):
                group.other = (lambda x: replicas(x) + float("inf")) if step == 1 else replicas
                x, y = _batch(step)
                for model, sc in ((m, scaler), (ref, ref_scaler)):
                    loss = paddle.nn.functional.mse_loss(model(x), y)
                    sc.scale(loss).backward()
                _average_like_two_ranks(ref.parameters(), group)
                if use_minimize:
                    scaler.minimize(opt, loss)
                    ref_scaler.minimize(ref_opt, loss)
                else:
                    scaler.step(opt)
                    scaler.update()
                    ref_scaler.step(ref_opt)
                    ref_scaler.update()
                assert bool(scaler._found_inf) == (step == 1), f"step {step}: inf check saw {scaler._found_inf}"
                for p, q in zip(m.parameters(), ref.parameters()):
                    np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=f"step {step} {p.name}")
                opt.clear_grad()
                ref_opt.clear_grad()
        finally:
            gb.remove()
