"""CUDAGraphedLayer on one process with the eager emulation backend, compared
bitwise with the plain layer (the idea of Paddle's test_cuda_graphed_layer.py)."""
import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker as fleet_rng_tracker

from paddle_hybrid import CUDAGraphedLayer, GraphPool
from paddle_hybrid.dygraph.cuda_graph import (
    CudaGraphError,
    GraphOrderError,
    SignatureChangeError,
    StaticBufferReuseError,
    cuda_graphs_available,
)


class MLP(paddle.nn.Layer):
    def __init__(self, p=0.0, norm=False):
        super().__init__()
        self.fc1 = paddle.nn.Linear(8, 16)
        self.norm = paddle.nn.BatchNorm1D(16) if norm else None
        self.drop = paddle.nn.Dropout(p)
        self.fc2 = paddle.nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.fc2(self.drop(paddle.nn.functional.gelu(h)))


class ThreeOut(paddle.nn.Layer):
    """Three outputs, nested in tuples and dicts; ``idx`` (argmax) is not
    differentiable.  ``where`` puts it first, in the middle or last of the
    flattened outputs: autograd hands the backward one gradient per output, so
    a backward that indexes them as if only differentiable outputs counted
    takes the wrong gradient wherever a differentiable output comes after it,
    which puts it anywhere but last."""

    ORDERS = {"first": ("idx", "h", "b"), "middle": ("h", "idx", "b"), "last": ("h", "b", "idx")}

    def __init__(self, where="last"):
        super().__init__()
        self.where = where
        self.a = paddle.nn.Linear(8, 8)
        self.b = paddle.nn.Linear(8, 4)

    def forward(self, x, scale=1.0):
        h = self.a(x) * scale
        out = {"h": h, "b": self.b(h), "idx": paddle.argmax(h, axis=-1)}
        first, second, third = (out[k] for k in self.ORDERS[self.where])
        return first, {"second": second, "third": [third]}

    def named(self, result):
        """The outputs of a call by name."""
        first, rest = result
        return dict(zip(self.ORDERS[self.where], (first, rest["second"], rest["third"][0])))


class CorruptedSchedule(CUDAGraphedLayer):
    """Every forward lands on graph pair 0, as if the schedule were corrupted;
    each buffer-reuse check can be switched off to show what the other checks
    catch and what goes wrong without them."""

    check_free = True  # forward side: the pair is not in flight
    check_holds = True  # backward side: the pair still holds this microbatch (generation)

    def _position_in_cycle(self, sig):
        super()._position_in_cycle(sig)
        return 0

    def _check_pair_free(self, pair):
        if self.check_free:
            super()._check_pair_free(pair)

    def _check_pair_holds(self, microbatch):
        if self.check_holds:
            super()._check_pair_holds(microbatch)


class UnorderedPool(GraphPool):
    """A pool that lets its graphs replay in any order."""

    def check_replay_order(self, position, what):
        pass


def make(cls, seed, **kw):
    paddle.seed(seed)
    return cls(**kw)


def params_np(layer):
    return [p.numpy() for p in layer.parameters()]


def grads_np(layer):
    return [None if p.grad is None else p.grad.numpy() for p in layer.parameters()]


def assert_bitwise(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}[{i}]: one is None"
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=f"{what}[{i}]")


def inputs(n, seed=7, shape=(4, 8)):
    paddle.seed(seed)
    return [paddle.randn(list(shape)) for _ in range(n)]


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_ten_steps_bitwise_equal_to_plain_layer(p):
    ref = make(MLP, 1, p=p)
    graphed = CUDAGraphedLayer(make(MLP, 1, p=p), num_warmup_steps=2, backend="emulation")
    assert_bitwise(params_np(ref), params_np(graphed.layer), "initial params")
    opt_r = paddle.optimizer.AdamW(1e-2, parameters=ref.parameters())
    opt_g = paddle.optimizer.AdamW(1e-2, parameters=graphed.parameters())
    xs = inputs(10)
    for step in range(10):
        paddle.seed(100 + step)
        loss_r = (ref(xs[step]) ** 2).mean()
        loss_r.backward()
        paddle.seed(100 + step)
        loss_g = (graphed(xs[step]) ** 2).mean()
        loss_g.backward()
        assert loss_r.numpy() == loss_g.numpy(), step
        assert_bitwise(grads_np(ref), grads_np(graphed.layer), f"grads step {step}")
        assert graphed.queue_length() == 0 and graphed.pool.in_flight == 0
        opt_r.step()
        opt_g.step()
        opt_r.clear_grad()
        opt_g.clear_grad()
        assert_bitwise(params_np(ref), params_np(graphed.layer), f"params step {step}")
    assert graphed.num_graph_pairs() == 1  # one microbatch in flight at a time
    # The parameters trained (a wrapper that loses gradients would leave them).
    assert not np.array_equal(params_np(ref)[0], params_np(make(MLP, 1, p=p))[0])


def test_warmup_leaves_buffers_and_rng_alone():
    # BatchNorm updates running statistics in every training forward: warmup
    # runs that were not undone would change them.
    ref = make(MLP, 3, norm=True, p=0.2)
    graphed = CUDAGraphedLayer(make(MLP, 3, norm=True, p=0.2), num_warmup_steps=3, backend="emulation")
    xs = inputs(3)
    for step in range(3):
        paddle.seed(9)
        ref(xs[step]).sum().backward()
        out_r = paddle.rand([3]).numpy()  # next random numbers after the step
        paddle.seed(9)
        graphed(xs[step]).sum().backward()
        out_g = paddle.rand([3]).numpy()
        np.testing.assert_array_equal(out_r, out_g)
        assert_bitwise([b.numpy() for b in ref.buffers()], [b.numpy() for b in graphed.layer.buffers()],
                       f"buffers step {step}")
        assert_bitwise(grads_np(ref), grads_np(graphed.layer), f"grads step {step}")


TRACKED = "paddle_hybrid_test_dropout"


@pytest.fixture
def tracker():
    """Fleet's model-parallel RNG tracker with one more state, taken out again after the test."""
    t = fleet_rng_tracker()
    saved = dict(t.states_), set(t.seeds_)
    t.add(TRACKED, 4321)
    yield t
    t.states_, t.seeds_ = saved


class TrackedDropout(paddle.nn.Layer):
    """Dropout drawing from a state of fleet's tracker, as tensor-parallel layers do."""

    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(8, 16)
        self.fc2 = paddle.nn.Linear(16, 8)

    def forward(self, x):
        h = paddle.nn.functional.gelu(self.fc1(x))
        with fleet_rng_tracker().rng_state(TRACKED):
            h = paddle.nn.functional.dropout(h, 0.5)
        return self.fc2(h)


def test_warmup_leaves_fleet_rng_tracker_alone(tracker):
    # Warmup draws dropout masks from the tracker; were its state not put
    # back, the captured run would draw other masks than the plain layer.
    ref = make(TrackedDropout, 14)
    graphed = CUDAGraphedLayer(make(TrackedDropout, 14), num_warmup_steps=3, backend="emulation")
    start = tracker.get_states_tracker()
    for step, x in enumerate(inputs(3)):
        tracker.set_states_tracker(start)
        ref(x).sum().backward()
        with tracker.rng_state(TRACKED):
            next_r = paddle.rand([3]).numpy()
        tracker.set_states_tracker(start)
        graphed(x).sum().backward()
        with tracker.rng_state(TRACKED):
            next_g = paddle.rand([3]).numpy()
        np.testing.assert_array_equal(next_r, next_g, err_msg=f"tracker after step {step}")
        assert_bitwise(grads_np(ref), grads_np(graphed.layer), f"grads step {step}")
        ref.clear_gradients()
        graphed.clear_gradients()


def test_rng_tracker_that_cannot_be_read_stops_warmup(tracker, monkeypatch):
    def unreadable():
        raise RuntimeError("tracker state unreadable")

    monkeypatch.setattr(tracker, "get_states_tracker", unreadable)
    graphed = CUDAGraphedLayer(make(MLP, 15), num_warmup_steps=1, backend="emulation")
    with pytest.raises(CudaGraphError, match="could not read the states of fleet's model-parallel RNG tracker") as info:
        graphed(inputs(1)[0])
    assert "tracker state unreadable" in str(info.value)


def test_rng_tracker_that_cannot_be_restored_raises_after_putting_back_the_rest(tracker, monkeypatch):
    def refuses(states):
        raise RuntimeError("tracker refuses the states")

    monkeypatch.setattr(tracker, "set_states_tracker", refuses)
    layer = make(MLP, 16, norm=True, p=0.2)
    graphed = CUDAGraphedLayer(layer, num_warmup_steps=2, backend="emulation")
    buffers_before = [b.numpy().copy() for b in layer.buffers()]
    x = inputs(1)[0]
    paddle.seed(5)
    expected = paddle.rand([3]).numpy()
    paddle.seed(5)
    with pytest.raises(CudaGraphError, match="could not put back the states of fleet's model-parallel RNG") as info:
        graphed(x)
    assert "tracker refuses the states" in str(info.value)
    # Paddle's generator and the layer's buffers were put back all the same.
    np.testing.assert_array_equal(paddle.rand([3]).numpy(), expected)
    assert_bitwise([b.numpy() for b in layer.buffers()], buffers_before, "buffers")


def test_several_microbatches_in_flight_and_stage0_inputs():
    # Inputs need no gradient (pipeline stage 0): parameters must still get theirs.
    ref = make(MLP, 2)
    graphed = CUDAGraphedLayer(make(MLP, 2), num_warmup_steps=1, backend="emulation")
    for step in range(4):
        xs = inputs(3, seed=step)
        assert all(x.stop_gradient for x in xs)
        losses_r = [(ref(x) ** 2).sum() for x in xs]
        losses_g = [(graphed(x) ** 2).sum() for x in xs]
        assert graphed.queue_length() == 3 and graphed.pool.in_flight == 3
        paddle.add_n(losses_r).backward()
        paddle.add_n(losses_g).backward()
        assert graphed.queue_length() == 0 and graphed.pool.in_flight == 0
        assert_bitwise([l.numpy() for l in losses_r], [l.numpy() for l in losses_g], "losses")
        assert_bitwise(grads_np(ref), grads_np(graphed.layer), f"grads step {step}")
        assert all(g is not None and np.abs(g).sum() > 0 for g in grads_np(graphed.layer))
        ref.clear_gradients()
        graphed.clear_gradients()
    assert graphed.num_graph_pairs() == 3


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_input_gradients_and_several_outputs(where):
    ref = make(ThreeOut, 4, where=where)
    graphed = CUDAGraphedLayer(make(ThreeOut, 4, where=where), num_warmup_steps=1, backend="emulation")
    for step in range(3):
        x_r = inputs(1, seed=step)[0]
        x_r.stop_gradient = False
        x_g = x_r.detach()
        x_g.stop_gradient = False
        out_g = graphed(x_g, scale=2.0)
        assert isinstance(out_g, tuple) and isinstance(out_g[1], dict) and isinstance(out_g[1]["third"], list)
        r, g = ref.named(ref(x_r, scale=2.0)), graphed.layer.named(out_g)
        assert g["idx"].stop_gradient and g["idx"].dtype == r["idx"].dtype
        np.testing.assert_array_equal(r["idx"].numpy(), g["idx"].numpy())
        # Different weights on h and b: a gradient handed to the wrong output changes the numbers.
        ((r["h"] ** 2).sum() + 3.0 * r["b"].sum()).backward()
        ((g["h"] ** 2).sum() + 3.0 * g["b"].sum()).backward()
        np.testing.assert_array_equal(x_r.grad.numpy(), x_g.grad.numpy())
        assert_bitwise(grads_np(ref), grads_np(graphed.layer), f"grads step {step}")
        ref.clear_gradients()
        graphed.clear_gradients()
    assert graphed.queue_length() == 0


def in_backward(exc_type, match):
    """Errors raised in a PyLayer backward reach the caller wrapped by Paddle
    (as OSError) with the original message inside."""
    return pytest.raises((exc_type, OSError), match=match)


def test_buffer_reused_before_its_backward_is_detected():
    """Two microbatches in flight forced onto one graph pair (a corrupted
    order): the reuse is detected; without the checks the numbers are wrong."""
    xs = inputs(2, seed=11)
    ref = make(MLP, 5)
    y_ref = ref(xs[0])
    y_ref.sum().backward()

    graphed = CorruptedSchedule(make(MLP, 5), num_warmup_steps=0, backend="emulation")
    y0 = graphed(xs[0])
    with pytest.raises(StaticBufferReuseError, match="backward has not run"):
        graphed(xs[1])
    # The order check is a second line of defence: graph 0 replayed twice in one cycle.
    graphed.check_free = False
    with pytest.raises(GraphOrderError, match="out of capture order"):
        graphed(xs[1])
    graphed.check_free = True
    y0.sum().backward()  # the first microbatch still completes, correctly
    assert_bitwise(grads_np(ref), grads_np(graphed.layer), "grads after a refused reuse")
    assert graphed.queue_length() == 0

    # The same corrupted order with the checks off: the first microbatch's
    # output and gradients are the second one's.
    unchecked = CorruptedSchedule(make(MLP, 5), num_warmup_steps=0, pool=UnorderedPool("emulation"))
    unchecked.check_free = unchecked.check_holds = False
    y0 = unchecked(xs[0])
    np.testing.assert_array_equal(y0.numpy(), y_ref.numpy())
    unchecked(xs[1])
    assert not np.allclose(y0.numpy(), y_ref.numpy())
    y0.sum().backward()
    assert any(not np.allclose(a, b) for a, b in zip(grads_np(unchecked.layer), grads_np(ref)))

    # The backward-side check (generation count) catches a refill that
    # slipped past the forward-side checks.
    late = CorruptedSchedule(make(MLP, 5), num_warmup_steps=0, pool=UnorderedPool("emulation"))
    first = late(xs[0])
    late.check_free = False
    late(xs[1])
    with in_backward(StaticBufferReuseError, "refilled by another microbatch"):
        first.sum().backward()


def test_replay_out_of_capture_order_is_an_error():
    graphed = CUDAGraphedLayer(make(MLP, 6), num_warmup_steps=0, backend="emulation")
    xs = inputs(2)
    a, b = graphed(xs[0]).sum(), graphed(xs[1]).sum()
    a.backward()
    b.backward()  # captured: F0 F1 B0 B1
    a, b = graphed(xs[0]).sum(), graphed(xs[1]).sum()
    b.backward()  # B1 after F1: still in capture order
    with in_backward(GraphOrderError, "out of capture order"):
        a.backward()  # B0 after B1: not
    graphed.pool.reset()
    assert graphed.num_graph_pairs() == 0 and graphed.queue_length() == 0 and graphed.pool.in_flight == 0
    a, b = graphed(xs[0]).sum(), graphed(xs[1]).sum()
    b.backward()
    a.backward()
    assert graphed.queue_length() == 0 and graphed.num_graph_pairs() == 2


def test_new_input_shape_recaptures_or_raises():
    ref = make(MLP, 8)
    graphed = CUDAGraphedLayer(make(MLP, 8), num_warmup_steps=1, backend="emulation")
    for shape in [(4, 8), (6, 8), (4, 8), (6, 8)]:
        x = inputs(1, shape=shape)[0]
        (ref(x) ** 2).sum().backward()
        (graphed(x) ** 2).sum().backward()
        assert_bitwise(grads_np(ref), grads_np(graphed.layer), f"grads {shape}")
    assert graphed.num_signatures() == 2
    # dtype change: a new signature too
    x64 = inputs(1)[0].astype("float64")
    strict = CUDAGraphedLayer(make(MLP, 8), backend="emulation", recapture=False, num_warmup_steps=0)
    strict(inputs(1)[0]).sum().backward()
    with pytest.raises(SignatureChangeError, match="recapture=False"):
        strict(inputs(1, shape=(5, 8))[0])
    with pytest.raises(SignatureChangeError, match="recapture=False"):
        strict(x64)
    capped = CUDAGraphedLayer(make(MLP, 8), backend="emulation", max_signatures=1, num_warmup_steps=0)
    capped(inputs(1)[0]).sum().backward()
    with pytest.raises(SignatureChangeError, match="max_signatures=1"):
        capped(inputs(1, shape=(3, 8))[0])


def test_eval_and_no_grad_run_eagerly():
    ref = make(MLP, 9, p=0.5)
    graphed = CUDAGraphedLayer(make(MLP, 9, p=0.5), num_warmup_steps=0, backend="emulation")
    x = inputs(1)[0]
    ref.eval()
    graphed.eval()
    np.testing.assert_array_equal(ref(x).numpy(), graphed(x).numpy())
    graphed.train()
    ref.train()
    with paddle.no_grad():
        paddle.seed(1)
        a = ref(x).numpy()
        paddle.seed(1)
        b = graphed(x).numpy()
    np.testing.assert_array_equal(a, b)
    assert graphed.num_graph_pairs() == 0 and graphed.queue_length() == 0
    # eval reached only the wrapped layer (as PipelineLayer 1F1B does): eager too
    graphed.layer.eval()
    ref.eval()
    np.testing.assert_array_equal(ref(x).numpy(), graphed(x).numpy())
    assert graphed.num_graph_pairs() == 0
    graphed.layer.train()
    graphed(x).sum().backward()
    assert graphed.num_graph_pairs() == 1 and graphed.queue_length() == 0


def test_output_neither_tensor_nor_constant_is_named():
    class ReturnsSet(MLP):
        def forward(self, x):
            return super().forward(x), {"labels": {1, 2}}  # a set: unhashable, not walked into

    graphed = CUDAGraphedLayer(make(ReturnsSet, 10), num_warmup_steps=0, backend="emulation")
    with pytest.raises(CudaGraphError, match="returned set, neither a tensor nor a hashable constant"):
        graphed(inputs(1)[0])


def test_forward_without_backward_is_bounded():
    graphed = CUDAGraphedLayer(make(MLP, 10), num_warmup_steps=0, backend="emulation", max_graphs=3)
    x = inputs(1)[0]
    keep = [graphed(x) for _ in range(3)]
    with pytest.raises(CudaGraphError, match="max_graphs=3"):
        graphed(x)
    assert graphed.queue_length() == 3 and len(keep) == 3


def test_layers_share_one_pool_captured_in_run_order():
    pool = GraphPool("emulation")
    first = CUDAGraphedLayer(make(MLP, 12), pool=pool, num_warmup_steps=0)
    second = CUDAGraphedLayer(make(MLP, 13), pool=pool, num_warmup_steps=0)
    plain1, plain2 = make(MLP, 12), make(MLP, 13)
    for step in range(3):
        xs = inputs(2, seed=step)
        ys = [second(first(x)) for x in xs]
        assert pool.in_flight == 4
        paddle.add_n([y.sum() for y in ys]).backward()
        paddle.add_n([plain2(plain1(x)).sum() for x in xs]).backward()
        assert pool.in_flight == 0 and first.queue_length() == 0 and second.queue_length() == 0
    positions = sorted(p.fwd_position for pairs in first._pairs.values() for p in pairs)
    positions += sorted(p.fwd_position for pairs in second._pairs.values() for p in pairs)
    assert sorted(positions) == [0, 1, 2, 3]  # F(first,0) F(second,0) F(first,1) F(second,1)
    assert_bitwise(grads_np(plain1) + grads_np(plain2), grads_np(first.layer) + grads_np(second.layer), "grads")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_warmup_steps"):
        CUDAGraphedLayer(make(MLP, 1), num_warmup_steps=-1)
    with pytest.raises(ValueError, match="max_graphs"):
        CUDAGraphedLayer(make(MLP, 1), max_graphs=0)
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        CUDAGraphedLayer(lambda x: x)
    with pytest.raises(ValueError, match="backend must be"):
        CUDAGraphedLayer(make(MLP, 1), backend="tpu")
    if not cuda_graphs_available():
        with pytest.raises(RuntimeError, match="cannot capture CUDA graphs"):
            CUDAGraphedLayer(make(MLP, 1), backend="cuda")
