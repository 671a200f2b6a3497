"""Removing gradient buckets (``GradBuckets.remove()``, and the component's uninstall) takes
their hooks off the parameters: afterwards no code of the bucket package runs during training
(checked with a profiler hook), and after an uninstall the model trains as stock Paddle."""
import numpy as np

import paddle

import paddle_hybrid
from paddle_hybrid.catalog import install as _install
from bucket_fakes import bucket_code_calls

COMPONENT = "grad_buckets"


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 4))


def _backward(model, step):
    rng = np.random.default_rng(step)
    model(paddle.to_tensor(rng.standard_normal((4, 8)).astype("float32"))).mean().backward()


def _step(model, opt, step):
    _backward(model, step)
    opt.step()
    opt.clear_grad()


def test_remove_takes_every_hook_off():
    """While the component stays installed: no function of the package is called back from a
    backward of the model once its buckets are removed."""
    m = _model()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    gb = paddle_hybrid.GradBuckets(m.parameters(), group=None)
    assert bucket_code_calls(lambda: _backward(m, 0), only_called_by_paddle=True), "sanity: hooks run"
    opt.step()
    opt.clear_grad()
    gb.remove()
    assert bucket_code_calls(lambda: _backward(m, 1), only_called_by_paddle=True) == []


def test_uninstall_component_restores_paddle_and_removes_buckets():
    state = _install.component_state(COMPONENT)
    assert state is not None and state.status == "active"
    changes = state.patcher.changes()
    m, ref = _model(), _model()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    ref_opt = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
    gb = paddle_hybrid.GradBuckets(m.parameters(), group=None)
    _step(m, opt, 0)
    _step(ref, ref_opt, 0)
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component(COMPONENT)
    try:
        for owner, name, original, installed in changes:
            now = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
            # Restored, or (another component wrapped it after this one: fleet_fixes reinstalled by
            # an earlier test) this one's link spliced out of the chain (registry.patching).
            assert now is original or getattr(installed, "_ph_spliced", False), \
                f"{getattr(owner, '__name__', owner)}.{name} not restored"
        for step in (1, 2):
            assert bucket_code_calls(lambda: _step(m, opt, step)) == [], f"step {step}"
            _step(ref, ref_opt, step)
        for p, q in zip(m.parameters(), ref.parameters()):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
    finally:
        paddle_hybrid.install_component(COMPONENT, config)
    del gb
