"""Recompute with dropout on CPU (paddle_hybrid.dygraph.cpu.recompute).

In one process: a block with dropout drawn from Paddle's generator *and* from fleet's
model-parallel ``RNGStatesTracker`` gives, under recompute, gradients equal (exactly:
same arithmetic, same masks) to the block without recompute under the same seeds, for
plain ``fleet.utils.recompute`` (re-entrant and not) and for ``recompute_hybrid``
(plain, ``offload``, ``partition``).  The same comparison fails when the recompute does
not replay the forward's random states (``preserve_rng_state=False``; recompute_hybrid
with its state switch replaced by a no-op), so it does test the replay.  Stock Paddle
3.3.1 refuses recompute_hybrid on CPU ("Recompute with RNG is not support current
device: cpu.").

On 2 gloo ranks (``worker_recompute.py``, one launch): ``PipelineLayer`` with
``recompute_interval=1`` (also with ``offload``), dropout p=0.3 in the blocks, SGD,
PP=2, 4 microbatches, 5 steps, against the same run without recompute: losses and
parameters exactly equal on every rank (same random draws); with the state switch
disabled they differ.  Both against a single-process run that keeps one (Paddle,
tracker) random state per stage, so it draws the pipeline's masks: rtol 0, atol 1e-5
(accumulation order may differ; observed: exactly equal).  recompute_hybrid with
``partition=True`` over the 2-rank group (each rank keeps half the activation, the
backward all-gathers it over gloo) vs no recompute: exact.
"""
import contextlib
import importlib
import os

import numpy as np
import pytest

import paddle
import paddle.nn.functional as F
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph import cpu
from paddle_hybrid.testing import launch

from paddle.distributed.fleet.layers.mpu.random import MODEL_PARALLEL_RNG, get_rng_state_tracker

HERE = os.path.dirname(os.path.abspath(__file__))
ATOL = 1e-5

hybrid_mod = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")


class _OneRank:
    """What recompute_hybrid reads of an mp group, for one process."""
    nranks = 1
    rank = 0


@pytest.fixture
def tracker():
    """The global model-parallel tracker with one state, put back as it was afterwards."""
    tr = get_rng_state_tracker()
    saved = (dict(tr.states_), set(tr.seeds_))
    tr.reset()
    tr.add(MODEL_PARALLEL_RNG, 4321)
    tr.initial_states = tr.get_states_tracker()  # what every run below starts from
    yield tr
    del tr.initial_states
    tr.states_, tr.seeds_ = saved


def _block():
    paddle.seed(3)
    lin1, lin2 = paddle.nn.Linear(6, 6), paddle.nn.Linear(6, 3)

    def block(h):
        h = F.dropout(paddle.tanh(lin1(h)), 0.5)  # Paddle's CPU generator
        with get_rng_state_tracker().rng_state():  # the tracker's state
            h = F.dropout(h, 0.5)
        return lin2(h)

    return block, [lin1.weight, lin1.bias, lin2.weight, lin2.bias]


def _grads(tracker, call):
    """Gradients of x and of the block's parameters, from fixed random states."""
    block, params = _block()
    out = []
    for _ in range(2):  # twice: the second run must not depend on the first
        paddle.seed(17)
        tracker.set_states_tracker(tracker.initial_states)
        x = paddle.to_tensor(np.linspace(-1, 1, 24, dtype="float32").reshape(4, 6), stop_gradient=False)
        h = x * 2.0  # the recomputed block's input needs a gradient
        y = call(block, h)
        (y * y).sum().backward()
        out.append([x.grad.numpy()] + [p.grad.numpy().copy() for p in params])
        for p in params:
            p.clear_gradient()
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
    return out[0]


def _same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b))


@contextlib.contextmanager
def _no_state_switch():
    """recompute_hybrid's backward recomputes from whatever random state is current."""
    saved = hybrid_mod.switch_rng_state_tracker
    hybrid_mod.switch_rng_state_tracker = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        hybrid_mod.switch_rng_state_tracker = saved


def test_cpu_generator_and_tracker_state_round_trip(tracker):
    s0, t0 = paddle.get_rng_state(), tracker.get_states_tracker()
    with tracker.rng_state():
        a_tr = paddle.rand([5]).numpy()
    a = paddle.rand([5]).numpy()
    paddle.set_rng_state(s0)
    tracker.set_states_tracker(t0)
    with tracker.rng_state():
        b_tr = paddle.rand([5]).numpy()
    b = paddle.rand([5]).numpy()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a_tr, b_tr)
    assert not np.array_equal(a, a_tr)  # two different streams


@pytest.mark.parametrize("reentrant", [True, False])
def test_plain_recompute_replays_dropout(tracker, reentrant):
    from paddle.distributed.fleet.utils import recompute

    ref = _grads(tracker, lambda f, h: f(h))
    got = _grads(tracker, lambda f, h: recompute(f, h, use_reentrant=reentrant))
    assert _same(ref, got)
    # Without the replay the recompute draws other masks: the comparison can fail.
    bad = _grads(tracker, lambda f, h: recompute(f, h, use_reentrant=reentrant, preserve_rng_state=False))
    assert not _same(ref, bad)


@pytest.mark.parametrize("ctx", [{}, {"offload": True}, {"partition": True}], ids=["plain", "offload", "partition"])
def test_hybrid_recompute_replays_dropout(tracker, ctx):
    from paddle.incubate.distributed.fleet import recompute_hybrid

    ref = _grads(tracker, lambda f, h: f(h))
    got = _grads(tracker, lambda f, h: recompute_hybrid({"mp_group": _OneRank(), **ctx}, f, h))
    assert _same(ref, got)
    with _no_state_switch():
        bad = _grads(tracker, lambda f, h: recompute_hybrid({"mp_group": _OneRank(), **ctx}, f, h))
    assert not _same(ref, bad)


def test_hybrid_recompute_keeps_the_callers_tensor(tracker):
    """partition=True: stock split the caller's activation with an in-place flatten_."""
    from paddle.incubate.distributed.fleet import recompute_hybrid

    block, _ = _block()
    x = paddle.ones([4, 6])
    x.stop_gradient = False
    h = paddle.tanh(x)  # tanh's backward keeps h: an in-place change would break it
    y = recompute_hybrid({"mp_group": _OneRank(), "partition": True}, block, h)
    assert list(h.shape) == [4, 6]
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the stock failure is CPU-only")
def test_stock_hybrid_recompute_refuses_cpu(fresh_plugin, tracker):
    from paddle.incubate.distributed.fleet import recompute_hybrid

    x = paddle.ones([2, 6])
    x.stop_gradient = False
    with pytest.raises(AssertionError, match="Recompute with RNG is not support current device: cpu"):
        recompute_hybrid({"mp_group": _OneRank()}, paddle.nn.Linear(6, 6), x * 1.0)
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    recompute_hybrid({"mp_group": _OneRank()}, paddle.nn.Linear(6, 6), x * 1.0).sum().backward()


def test_uninstall_restores_recompute_patches(fresh_plugin):
    fn_cls = hybrid_mod._HPRecomputeFunction

    def current():
        return {"forward": fn_cls.__dict__["forward"], "merge": hybrid_mod._merge_activation}

    stock = current()
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    patched = current()
    for k in stock:
        assert patched[k] is not stock[k], k
    assert (fn_cls, "forward") in cpu.patched() and (hybrid_mod, "_merge_activation") in cpu.patched()
    paddle_hybrid.uninstall_component("cpu")
    after = current()
    for k in stock:
        assert after[k] is stock[k], k


def test_pp2_recompute_interval_with_dropout_matches_no_recompute():
    results = launch(os.path.join(HERE, "worker_recompute.py"), nprocs=2, timeout=240,
                     args=["--variants", "rc=0;rc=1;rc=1,offload=1;rc=1,norestore=1", "--steps", "5"])
    assert [r["stage"] for r in results] == [0, 1]
    for r in results:
        v = r["variants"]
        base = v["rc=0"]
        assert len(base["losses"]) == 5 and base["params"]
        for spec in ("rc=1", "rc=1,offload=1"):
            assert v[spec]["losses"] == base["losses"], (r["rank"], spec)
            for k, want in base["params"].items():
                np.testing.assert_array_equal(v[spec]["params"][k], want, err_msg=f"rank {r['rank']} {spec} {k}")
        for spec in ("rc=0", "rc=1", "rc=1,offload=1"):
            np.testing.assert_allclose(v[spec]["losses"], v[spec]["ref_losses"], rtol=0, atol=ATOL)
            for k, got in v[spec]["params"].items():
                np.testing.assert_allclose(got, v[spec]["ref_params"][k], rtol=0, atol=ATOL,
                                           err_msg=f"rank {r['rank']} {spec} {k} vs one process")
        # The check can fail: a recompute that does not replay the forward's states.
        bad = v["rc=1,norestore=1"]
        assert not all(np.array_equal(bad["params"][k], base["params"][k]) for k in base["params"]), r["rank"]
        part = r["partition"]
        for k in part["plain"]:
            np.testing.assert_array_equal(part["partition"][k], part["plain"][k], err_msg=f"rank {r['rank']} {k}")
    assert results[0]["variants"]["rc=1"]["losses"] == results[1]["variants"]["rc=1"]["losses"]
