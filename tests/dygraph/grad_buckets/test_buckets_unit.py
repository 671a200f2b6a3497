"""Gradient buckets in one process: the plan, gradients as aliases of the buffers across
backward / optimizer steps / clear_grad, repairs, readiness signals, ``no_sync``, the layout
check and misuse errors.  ``FakeGroup`` plays a second rank where averaging matters."""
import json

import numpy as np
import pytest

import paddle

import paddle_hybrid
from paddle_hybrid.dygraph import grad_buckets
from paddle_hybrid.common import layout_check
from paddle_hybrid.dygraph.grad_buckets import GradBuckets, GradSyncError, plan_buckets
from paddle_hybrid.dygraph.grad_buckets.readiness import Readiness
from bucket_fakes import FakeGroup, SyncingOptimizer, delayed_all_reduce


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 16),
                                paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _x(step=0, rows=6):
    return paddle.to_tensor(np.random.default_rng(step).standard_normal((rows, 8)).astype("float32"))


def _in_buffer(gb):
    return all(b.is_bound(i) for b in gb.buckets for i in range(len(b.params)))


# -- data ------------------------------------------------------------------------------------

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
    assert [len(b) for b in plan_buckets(ps[:2] + [half], 1 << 20, main_grad=True)] == [3]  # all fp32
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(ps, 0)


def test_existing_gradients_are_kept_and_become_aliases():
    m = _model()
    m(_x()).sum().backward()
    before = [p.grad.numpy().copy() for p in m.parameters()]
    gb = GradBuckets(m.parameters(), group=None, bucket_size_mb=0.001)
    try:
        assert _in_buffer(gb)
        for p, want in zip(m.parameters(), before):
            np.testing.assert_array_equal(p.grad.numpy(), want)
    finally:
        gb.remove()


@pytest.mark.parametrize("set_to_zero", [True, False])
def test_grads_stay_aliases_across_steps_and_clear_grad(set_to_zero):
    """``clear_grad()`` zeroes the views in place; ``clear_grad(set_to_zero=False)`` keeps
    Paddle's promise (``.grad`` is None until the next backward), and that backward's
    gradients are views again, re-bound in their hooks (no repair copy), equal to stock."""
    m, ref = _model(), _model()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    ref_opt = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
    gb = GradBuckets(m.parameters(), group=None, bucket_size_mb=0.001)
    try:
        assert gb.stats()["num_buckets"] > 1
        for step in range(3):
            for model in (m, ref):
                with gb.no_sync():
                    model(_x(step)).mean().backward()  # two microbatches, the first unsynced
                model(_x(step + 10)).mean().backward()
            assert _in_buffer(gb)
            for p, q in zip(m.parameters(), ref.parameters()):
                np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
            opt.step()
            ref_opt.step()
            opt.clear_grad(set_to_zero=set_to_zero)
            ref_opt.clear_grad(set_to_zero=set_to_zero)
            if set_to_zero:
                assert _in_buffer(gb), f"step {step}"
                assert float(sum(b.buffer.abs().sum() for b in gb.buckets)) == 0.0
            else:
                assert all(p.grad is None for p in m.parameters()), f"step {step}: .grad must be None"
                assert all(q.grad is None for q in ref.parameters()), "sanity: Paddle's own contract"
        st = gb.stats()
        assert st["steps"] == 3 and st["bucket_syncs"] == 3 * st["num_buckets"] and st["view_repairs"] == 0
        # step 0 learns that every parameter gets one contribution per pass (from the no_sync
        # microbatch), so from then on each bucket starts from a hook during backward
        assert st["started_by_hook"] == 3 * st["num_buckets"]
        for p, q in zip(m.parameters(), ref.parameters()):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
    finally:
        gb.remove()


def test_replaced_grad_is_put_back_into_the_buffer(monkeypatch):
    m = _model()
    gb = GradBuckets(m.parameters(), group=None)
    try:
        m(_x()).sum().backward()
        want = [p.grad.numpy().copy() for p in m.parameters()]
        # Paddle's own clear_gradient (as if the plugin's routing were bypassed) drops the grads.
        monkeypatch.setattr(grad_buckets.wiring, "is_bucketed", lambda p: False)
        for p in m.parameters():
            p.clear_gradient(False)
        monkeypatch.undo()
        assert all(p.grad is None for p in m.parameters())
        m(_x()).sum().backward()  # Paddle assigns fresh gradient tensors
        assert gb.stats()["view_repairs"] == len(want)
        assert _in_buffer(gb)
        for p, w in zip(m.parameters(), want):
            np.testing.assert_array_equal(p.grad.numpy(), w)
    finally:
        gb.remove()


# -- protocol --------------------------------------------------------------------------------

def _average(model, group):
    """In place, what the two ranks' all_reduce makes of each local gradient g: g/2 + other(g/2)."""
    with paddle.no_grad():
        for q in model.parameters():
            half = q.grad * 0.5
            q.grad.copy_(half + group.other(half), False)


def test_two_synced_backwards_give_the_sum_of_two_averages():
    """A second backward outside no_sync() adds its local gradient onto the first average;
    syncing again averages both (what DataParallel's reducer gives)."""
    group = FakeGroup()
    m, ref = _model(), _model()
    with delayed_all_reduce():
        gb = GradBuckets(m.parameters(), group=group, check_layout=False)
        try:
            for step in (0, 1):
                m(_x(step)).mean().backward()
                ref(_x(step)).mean().backward()
                _average(ref, group)
            for p, q in zip(m.parameters(), ref.parameters()):
                np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
            assert gb.stats()["steps"] == 2
        finally:
            gb.remove()


def test_released_grads_come_back_as_averaged_views():
    """``clear_grad(set_to_zero=False)`` with two ranks (``FakeGroup``): ``.grad`` is None in
    between, as Paddle promises; the next backward's gradients are views of the buffers again
    (re-bound in the hooks, so no repair copy), averaged, equal to stock Paddle's gradients
    given the same average; parameters equal after three steps.  Exact: the same float ops."""
    group = FakeGroup()
    m, ref = _model(), _model()
    ref_opt = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
    with delayed_all_reduce():
        gb = GradBuckets(m.parameters(), group=group, bucket_size_mb=0.001, check_layout=False)
        opt = SyncingOptimizer(paddle.optimizer.SGD(0.1, parameters=m.parameters()), gb)
        try:
            for step in range(3):
                m(_x(step)).mean().backward()
                ref(_x(step)).mean().backward()
                _average(ref, group)
                assert _in_buffer(gb), f"step {step}: gradients are not views of the buffers"
                for p, q in zip(m.parameters(), ref.parameters()):
                    np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=f"step {step} {p.name}")
                opt.step()
                ref_opt.step()
                opt.clear_grad(set_to_zero=False)
                ref_opt.clear_grad(set_to_zero=False)
                assert all(p.grad is None for p in m.parameters()), f"step {step}"
            assert gb.stats()["view_repairs"] == 0 and gb.stats()["steps"] == 3
        finally:
            gb.remove()
    for p, q in zip(m.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=p.name)


def test_release_grads_rejects_a_foreign_parameter():
    m, other = _model(), _model(1)
    gb = GradBuckets(m.parameters(), group=None)
    try:
        with pytest.raises(ValueError, match="not in these buckets"):
            gb.release_grads([next(iter(other.parameters()))])
    finally:
        gb.remove()


def test_owner_driven_last_microbatch_and_finish():
    """How a pipeline drives the protocol: microbatches not last, the last one marked, the
    sync finished by the owner (not at the end of backward)."""
    group = FakeGroup()
    m, ref = _model(), _model()
    with delayed_all_reduce() as fake:
        gb = GradBuckets(m.parameters(), group=group, check_layout=False, finish_at_backward_end=False)
        try:
            for step in range(2):
                gb.is_last_microbatch = False
                for k in range(2):
                    m(_x(10 * step + k)).mean().backward()
                    ref(_x(10 * step + k)).mean().backward()
                assert len(fake.calls) == step * gb.stats()["num_buckets"], "nothing starts before the last"
                gb.is_last_microbatch = True
                m(_x(10 * step + 2)).mean().backward()
                ref(_x(10 * step + 2)).mean().backward()
                assert gb.stats()["bucket_syncs"] == (step + 1) * gb.stats()["num_buckets"]
                gb.finish_grad_sync()
                gb.finish_grad_sync()  # nothing new: no second all_reduce
                assert len(fake.calls) == (step + 1) * gb.stats()["num_buckets"]
                _average(ref, group)  # the sum of the three microbatches (and the previous average), averaged
                for p, q in zip(m.parameters(), ref.parameters()):
                    np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=f"step {step} {p.name}")
            assert gb.stats()["started_by_hook"] == 2 * gb.stats()["num_buckets"]
        finally:
            gb.remove()


def test_readiness_signals():
    r = Readiness([0, 0, 1], [2, 1])  # parameters 0, 1 in bucket 0; 2 in bucket 1
    r.is_last_microbatch = False
    for k in (0, 1, 1, 2):  # a pass in which 1 gets two contributions
        r.fire(k)
        assert not r.accumulated(k)
    assert not r.backward_done()
    r.is_last_microbatch = True
    r.fire(2)
    assert r.accumulated(2) and r.complete(1)  # learned: one contribution, final at once
    r.fire(0)
    assert not r.accumulated(0) and not r.complete(0)  # 1 still missing
    r.fire(1)
    assert not r.accumulated(1)  # learned: several contributions; waits for the end of the pass
    assert r.backward_done() and r.complete(0)
    r.new_window()
    assert not r.complete(0) and not r.complete(1)
    r.fire(2)
    r.accumulated(2)
    assert r.fire(2) is True and not r.complete(1)  # final, then another: the caller must check
    r.finalize_all()
    assert r.complete(0) and r.complete(1)


def test_no_sync_and_registry():
    m = _model()
    gb = GradBuckets(m.parameters(), group=None)
    try:
        assert all(grad_buckets.is_bucketed(p) for p in m.parameters())
        with pytest.raises(ValueError, match="already in gradient buckets"):
            GradBuckets(m.parameters(), group=None)
        with gb.no_sync():
            m(_x()).sum().backward()
        assert gb.stats()["bucket_syncs"] == 0
        m(_x()).sum().backward()
        assert gb.stats()["bucket_syncs"] == gb.stats()["num_buckets"] and gb.stats()["steps"] == 1
    finally:
        gb.remove()
    assert not any(grad_buckets.is_bucketed(p) for p in m.parameters())


def test_layout_mismatch_names_the_parameter(monkeypatch):
    m = _model()

    def exchange(payload, **kwargs):  # what the store gives back: JSON, rank 1's entry 2 differs
        mine = json.loads(json.dumps(payload, default=str))
        other = [list(e) for e in mine]
        other[2][2] = [17, 16]
        return {0: mine, 1: other}

    monkeypatch.setattr(layout_check, "exchange", exchange)
    named = r"parameter 'linear_\d+\.[wb]_0' shape \[16\] .* shape \[17, 16\]"
    with pytest.raises(paddle_hybrid.BucketLayoutError, match=named) as info:
        GradBuckets(m.parameters(), group=FakeGroup())
    assert "fuse_all_reduce_ops=False" in str(info.value)
    assert not any(grad_buckets.is_bucketed(p) for p in m.parameters())


# -- a backward that raised ----------------------------------------------------------------

def _failing_backward(model, step):
    """A backward whose hook on the first layer's weight (its gradient comes last) raises."""
    handle = model[0].weight.register_hook(lambda g: (_ for _ in ()).throw(ValueError("injected")))
    try:
        with pytest.raises(OSError, match="injected"):  # Paddle's report of a hook's exception
            model(_x(step)).mean().backward()
    finally:
        handle.remove()


@pytest.mark.parametrize("last_microbatch", [True, False])
def test_a_failed_pass_completes_its_sync_only_in_a_last_microbatch(last_microbatch):
    """A last microbatch that fails still issues every bucket's all_reduce once, in order (the
    other ranks issue theirs); an earlier microbatch (no_sync) issues none.  Either way the
    next step syncs normally: after clear_grad, gradients equal the two-rank average."""
    group = FakeGroup()
    m, ref = _model(), _model()
    with delayed_all_reduce() as fake:
        gb = GradBuckets(m.parameters(), group=group, bucket_size_mb=0.001, check_layout=False)
        try:
            n = gb.stats()["num_buckets"]
            if last_microbatch:
                _failing_backward(m, 0)
            else:
                with gb.no_sync():
                    _failing_backward(m, 0)
            assert len(fake.calls) == (n if last_microbatch else 0)
            assert gb.stats()["started_at_abort"] == (n if last_microbatch else 0)
            assert gb._tasks == {} and gb._next == 0 and gb.error is None
            for model in (m, ref):
                model.clear_gradients()
                model(_x(1)).mean().backward()
            _average(ref, group)
            assert len(fake.calls) == (2 * n if last_microbatch else n)
            for p, q in zip(m.parameters(), ref.parameters()):
                np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=p.name)
        finally:
            gb.remove()
