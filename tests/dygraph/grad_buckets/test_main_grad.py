"""Gradient buckets with fleet's main_grad recipe (``MixPrecisionLayer`` /
``MixPrecisionOptimizer``, paddle.distributed.fleet.utils.mix_precision_utils).

The recipe keeps each parameter's gradient in an fp32 ``param.main_grad`` (its hook adds
every incoming gradient there and leaves ``param.grad`` empty, asserting it is).  Buckets
built after ``MixPrecisionLayer`` hold the ``main_grad`` tensors as views (fp32) and sync
them; built before it they cannot, and step aside with one warning.  One process plays two
ranks (``FakeGroup``, the other rank's gradient differs from ours); the collective completes only at
``wait()``.  Reference: the recipe without buckets, ``main_grad`` replaced by the average.
"""
import warnings

import numpy as np
import pytest

import paddle
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer

import paddle_hybrid
from bucket_fakes import FakeGroup, SyncingOptimizer, delayed_all_reduce


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _batch(step):
    rng = np.random.default_rng(step)
    return (paddle.to_tensor(rng.standard_normal((6, 8)).astype("float32")),
            paddle.to_tensor(rng.standard_normal((6, 4)).astype("float32")))


def _train(model, opt, steps, average=None):
    for step in range(steps):
        x, y = _batch(step)
        paddle.nn.functional.mse_loss(model(x), y).backward()
        if average is not None:
            with paddle.no_grad():
                for p in model.parameters():
                    half = p.main_grad * 0.5
                    p.main_grad.copy_(half + average(half), False)
        opt.step()
        opt.clear_grad()


def test_buckets_hold_main_grad_as_fp32_views():
    group = FakeGroup()
    ref = MixPrecisionLayer(_model(), dtype="bfloat16")
    ref_opt = MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=ref.parameters()))
    _train(ref, ref_opt, 3, average=group.other)
    m = MixPrecisionLayer(_model(), dtype="bfloat16")
    with delayed_all_reduce():
        gb = paddle_hybrid.GradBuckets(m.parameters(), group=group, bucket_size_mb=0.001, check_layout=False)
        try:
            opt = SyncingOptimizer(MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=m.parameters())), gb)
            _train(m, opt, 3)
            for b in gb.buckets:
                assert str(b.buffer.dtype) == "paddle.float32"
            for p in m.parameters():
                assert p.grad is None, "main_grad recipe: param.grad stays empty"
                assert p.main_grad.dtype == paddle.float32
                assert any(p.main_grad.data_ptr() == v.data_ptr() for b in gb.buckets for v in b.views)
        finally:
            gb.remove()
    for p, q in zip(m.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=p.name)


def test_main_grad_dropped_by_clear_grad_comes_back_as_a_view():
    """``MixPrecisionOptimizer.clear_grad(set_to_zero=False)`` sets ``main_grad`` to None (its
    own clear; not routed through the buckets).  The recipe's hook then makes a fresh
    ``main_grad``, which the bucket puts back into its view when it starts (one copy per
    parameter: ``view_repairs``); values equal the recipe's without buckets, given the same
    average."""
    group = FakeGroup()
    ref = MixPrecisionLayer(_model(), dtype="bfloat16")
    ref_opt = MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=ref.parameters()))
    m = MixPrecisionLayer(_model(), dtype="bfloat16")
    with delayed_all_reduce():
        gb = paddle_hybrid.GradBuckets(m.parameters(), group=group, bucket_size_mb=0.001, check_layout=False)
        try:
            opt = SyncingOptimizer(MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=m.parameters())), gb)
            for step in range(3):
                x, y = _batch(step)
                for model in (m, ref):
                    paddle.nn.functional.mse_loss(model(x), y).backward()
                with paddle.no_grad():
                    for q in ref.parameters():
                        half = q.main_grad * 0.5
                        q.main_grad.copy_(half + group.other(half), False)
                for p, q in zip(m.parameters(), ref.parameters()):
                    assert any(p.main_grad.data_ptr() == v.data_ptr() for b in gb.buckets for v in b.views)
                    np.testing.assert_array_equal(p.main_grad.numpy(), q.main_grad.numpy(), err_msg=f"step {step}")
                opt.step()
                ref_opt.step()
                opt.clear_grad(set_to_zero=False)
                ref_opt.clear_grad(set_to_zero=False)
                assert all(p.main_grad is None for p in m.parameters())
            assert gb.stats()["view_repairs"] == 2 * len(list(m.parameters()))  # steps 1 and 2
        finally:
            gb.remove()
    for p, q in zip(m.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=p.name)


def test_mix_precision_layer_after_buckets_makes_them_step_aside():
    """MixPrecisionLayer applied after the buckets: the buckets cannot hold main_grad, so they
    step aside (one warning) and training is exactly the recipe's own."""
    ref = MixPrecisionLayer(_model(), dtype="bfloat16")
    ref_opt = MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=ref.parameters()))
    _train(ref, ref_opt, 2)
    plain = _model()
    gb = paddle_hybrid.GradBuckets(plain.parameters(), group=FakeGroup(), check_layout=False)
    try:
        m = MixPrecisionLayer(plain, dtype="bfloat16")
        opt = MixPrecisionOptimizer(paddle.optimizer.SGD(0.1, parameters=m.parameters()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(m, opt, 2)
        ours = [w for w in caught if "paddle_hybrid" in str(w.message)]
        assert len(ours) == 1 and "\n" not in str(ours[0].message), [str(w.message) for w in ours]
        assert "main_grad" in str(ours[0].message)
    finally:
        gb.remove()
    for p, q in zip(m.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=p.name)
