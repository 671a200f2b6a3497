"""A bucket starts its all_reduce only once every gradient in it is final (issue "Safe where
it cannot be run", readiness).

Re-entrant recompute runs a second, inner backward for the recomputed block: a parameter used
inside the block *and* outside it gets two gradient contributions per microbatch, and its hook
fires twice.  Counting hook calls to decide that a gradient is final starts its bucket after
the first contribution; the second then lands in a buffer already sent.  One process plays
two ranks (``FakeGroup``: the other rank's gradient differs from ours, so an early start changes the
numbers); the collective completes inside the call, as on gloo.
"""
import numpy as np
import pytest

import paddle
from paddle.distributed.fleet.utils import recompute

import paddle_hybrid
from bucket_fakes import FakeGroup, SyncingOptimizer, delayed_all_reduce


class Net(paddle.nn.Layer):
    """``shared`` is used inside the recomputed block and again after it."""

    def __init__(self):
        super().__init__()
        self.use_recompute = True
        self.pre, self.inner = paddle.nn.Linear(8, 16), paddle.nn.Linear(16, 16)
        self.shared, self.head = paddle.nn.Linear(16, 16), paddle.nn.Linear(16, 4)

    def block(self, h):
        return paddle.tanh(self.shared(paddle.tanh(self.inner(h))))

    def forward(self, x):
        h = paddle.tanh(self.pre(x))
        h = recompute(self.block, h) if self.use_recompute else self.block(h)  # re-entrant: a backward inside ours
        return self.head(paddle.tanh(self.shared(h)))


def _net(seed=0):
    paddle.seed(seed)
    return Net()


def _batch(step, micro):
    rng = np.random.default_rng(10 * step + micro)
    return (paddle.to_tensor(rng.standard_normal((4, 8)).astype("float32")),
            paddle.to_tensor(rng.standard_normal((4, 4)).astype("float32")))


def _loss(model, x, y):
    return paddle.nn.functional.mse_loss(model(x), y)


def test_shared_weight_hook_fires_twice_per_backward():
    """The premise: Paddle fires ``shared``'s gradient hook twice per backward."""
    m = _net()
    calls = []
    handle = m.shared.weight.register_hook(lambda g: calls.append(1))
    x, y = _batch(0, 0)
    _loss(m, x, y).backward()
    handle.remove()
    assert len(calls) == 2


@pytest.mark.parametrize("micro", [1, 2])
def test_twice_fired_hook_never_starts_a_bucket_early(micro):
    """``micro`` microbatches per step (all but the last under ``no_sync()``), two steps, one
    parameter per bucket.  Every all_reduce must send a complete local gradient (the sum of
    every contribution of every microbatch, halved), and the result must be the average."""
    group = FakeGroup()
    m, ref = _net(), _net()
    ref_opt = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
    with delayed_all_reduce(immediate=True) as fake:
        gb = paddle_hybrid.GradBuckets(m.parameters(), group=group, max_params=1, check_layout=False)
        opt = SyncingOptimizer(paddle.optimizer.SGD(0.1, parameters=m.parameters()), gb)
        try:
            for step in range(2):
                first_call = len(fake.calls)
                error = None
                try:
                    for k in range(micro):
                        x, y = _batch(step, k)
                        _loss(ref, x, y).backward()
                        if k < micro - 1:
                            with gb.no_sync():
                                _loss(m, x, y).backward()
                        else:
                            _loss(m, x, y).backward()
                except BaseException as exc:  # a hook that raises surfaces here as SystemError
                    error = exc
                local_halves = [p.grad.numpy() * 0.5 for p in ref.parameters()]
                sent = [c["sent"] for c in fake.calls[first_call:]]
                for s in sent:
                    assert any(s.size >= h.size and np.array_equal(s.reshape(-1)[:h.size], h.reshape(-1))
                               for h in local_halves), \
                        f"step {step}: an all_reduce sent a partial gradient (bucket started early)"
                assert error is None, f"step {step}: {error!r}"
                assert len(sent) == len(gb.buckets)
                opt.step()
                with paddle.no_grad():
                    for p in ref.parameters():
                        half = p.grad * 0.5
                        p.grad.copy_(half + group.other(half), False)
                ref_opt.step()
                for p, q in zip(m.parameters(), ref.parameters()):
                    np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=f"step {step} {p.name}")
                opt.clear_grad()
                ref_opt.clear_grad()
        finally:
            gb.remove()


def test_a_hook_that_starts_firing_twice_fails_loudly():
    """A parameter seen with one contribution per pass may start its bucket from its hook;
    if it later gets a second contribution in a pass (recompute switched on), the bucket
    was sent without it: that must raise, not give wrong numbers."""
    m = _net()
    m.use_recompute = False
    gb = paddle_hybrid.GradBuckets(m.parameters(), group=None, max_params=1)
    try:
        x, y = _batch(0, 0)
        _loss(m, x, y).backward()  # learns: one contribution each
        gb.finish_grad_sync()
        m.use_recompute = True
        # the bucket set's own error, not Paddle's generic OSError around it
        with pytest.raises(paddle_hybrid.GradSyncError, match="another contribution after its bucket's "
                                                             "all_reduce started"):
            _loss(m, x, y).backward()
        # reported once: nothing stale is left for the next step
        assert gb.error is None
        gb.finish_grad_sync()
        m.use_recompute = False
        m.clear_gradients()
        _loss(m, x, y).backward()
        ref = _net()
        ref.use_recompute = False
        _loss(ref, x, y).backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=p.name)
    finally:
        gb.remove()
