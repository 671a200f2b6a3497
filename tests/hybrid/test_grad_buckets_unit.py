"""Gradient buckets in one process: planning, gradients as views of the buffer across
backward / optimizer steps / clear_grad, hooks and misuse errors."""
import numpy as np
import pytest

import paddle
from paddle_hybrid.dygraph import grad_buckets
from paddle_hybrid.dygraph.grad_buckets import GradBuckets, GradSyncError, plan_buckets


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 16),
                                paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _in_buffer(buckets):
    return all(p.grad is not None and p.grad.data_ptr() == b.ptrs[i]
               for b in buckets.buckets for i, p in enumerate(b.params))


def test_plan_reverse_order_size_count_dtype():
    m = _model()
    ps = list(m.parameters())  # w0 (8x16), b0, w1 (16x16), b1, w2 (16x4), b2
    plan = plan_buckets(ps, bucket_bytes=1 << 20)
    assert [[p.name for p in b] for b in plan] == [[p.name for p in reversed(ps)]]
    plan = plan_buckets(ps, bucket_bytes=16 * 16 * 4)  # one 16x16 weight fills a bucket
    assert [len(b) for b in plan] == [3, 1, 2] and plan[1][0] is ps[2]
    assert [len(b) for b in plan_buckets(ps, 1 << 20, max_params=4)] == [4, 2]
    half = paddle.create_parameter([4], "float16")
    assert [len(b) for b in plan_buckets(ps[:2] + [half], 1 << 20)] == [1, 2]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(ps, 0)


def test_grads_stay_views_across_steps_and_clear_grad():
    m = _model()
    ref = _model()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    ref_opt = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
    gb = GradBuckets(m.parameters(), group=None, bucket_size_mb=0.001, accumulate_steps=2)
    try:
        assert gb.stats()["num_buckets"] > 1
        x = paddle.to_tensor(np.random.default_rng(0).standard_normal((6, 8)).astype("float32"))
        for step, clear in enumerate([True, False, True]):
            for model in (m, ref):
                for _ in range(2):  # two microbatches
                    model(x).mean().backward()
            assert _in_buffer(gb)
            for p, q in zip(m.parameters(), ref.parameters()):
                np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
            gb.finish_grad_sync()  # nranks == 1: no scaling; resets the counters
            opt.step()
            ref_opt.step()
            opt.clear_grad(set_to_zero=clear)
            ref_opt.clear_grad(set_to_zero=clear)
            assert _in_buffer(gb), f"step {step}, set_to_zero={clear}"
            assert float(sum(b.buffer.abs().sum() for b in gb.buckets)) == 0.0
        st = gb.stats()
        assert st["steps"] == 3 and st["bucket_syncs"] == 3 * st["num_buckets"]
        assert st["started_in_backward"] == st["bucket_syncs"] and st["view_repairs"] == 0
        for p, q in zip(m.parameters(), ref.parameters()):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
    finally:
        gb.remove()


def test_replaced_grad_is_repaired_into_the_view(monkeypatch):
    m = _model()
    gb = GradBuckets(m.parameters(), group=None)
    try:
        x = paddle.ones([2, 8])
        m(x).sum().backward()
        gb.finish_grad_sync()
        want = [p.grad.numpy().copy() for p in m.parameters()]
        # Paddle's own clear_gradient (as if the plugin's routing were bypassed) drops the grads.
        monkeypatch.setattr(grad_buckets, "is_bucketed", lambda p: False)
        for p in m.parameters():
            p.clear_gradient(False)
        monkeypatch.undo()
        assert all(p.grad is None for p in m.parameters())
        m(x).sum().backward()
        assert gb.stats()["view_repairs"] == len(want)  # all grads of the bucket were replaced
        assert _in_buffer(gb)
        for p, w in zip(m.parameters(), want):
            np.testing.assert_allclose(p.grad.numpy(), w, rtol=1e-6)
    finally:
        gb.remove()


def test_backward_without_step_raises():
    m = _model()
    gb = GradBuckets(m.parameters(), group=None, accumulate_steps=1)
    try:
        m(paddle.ones([2, 8])).sum().backward()
        with pytest.raises(BaseException) as info:
            m(paddle.ones([2, 8])).sum().backward()
        assert isinstance(gb.error, GradSyncError) and "was produced 2 times" in str(gb.error)
        with pytest.raises(GradSyncError, match="expect 1 backward pass"):
            gb.finish_grad_sync()
    finally:
        gb.remove()


def test_no_sync_accumulates_without_counting_and_registry():
    m = _model()
    gb = GradBuckets(m.parameters(), group=None)
    try:
        assert all(grad_buckets.is_bucketed(p) for p in m.parameters())
        with pytest.raises(ValueError, match="already in gradient buckets"):
            GradBuckets(m.parameters(), group=None)
        with gb.no_sync():
            m(paddle.ones([2, 8])).sum().backward()
        assert gb.stats()["bucket_syncs"] == 0
        m(paddle.ones([2, 8])).sum().backward()
        assert gb.stats()["bucket_syncs"] == gb.stats()["num_buckets"]
        gb.finish_grad_sync()
    finally:
        gb.remove()
    assert not any(grad_buckets.is_bucketed(p) for p in m.parameters())
