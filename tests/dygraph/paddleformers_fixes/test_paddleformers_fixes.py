"""paddleformers_fixes without PaddleFormers: the clip-norm hook fix on a Trainer that has the
1.2 defect's shape, and the version gate."""
import types
import warnings

import pytest

from paddle_hybrid.dygraph import paddleformers_fixes
from paddle_hybrid.dygraph.paddleformers_fixes import grad_norm_hook
from paddle_hybrid.registry.patching import Patcher


class _Clip:
    def _global_norm(self, dist_sum, not_dist_sum):
        return "paddle's norm"


def _trainer_module():
    """A Trainer whose _wrap_distributed_optimizer does what PaddleFormers 1.2's does: binds a
    new global-norm function to the wrapped optimizer's clip, assigns it via self.optimizer."""

    class Trainer:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def _wrap_distributed_optimizer(self, optimizer):
            dist_optimizer = types.SimpleNamespace(_inner_opt=types.SimpleNamespace(_grad_clip=_Clip()))

            def logged_norm(clip, *args):
                return "logged"

            self.optimizer._inner_opt._grad_clip._global_norm = types.MethodType(
                logged_norm, dist_optimizer._inner_opt._grad_clip)
            return dist_optimizer

    return types.SimpleNamespace(Trainer=Trainer)


def test_norm_hook_lands_on_the_wrapped_optimizers_clip():
    module = _trainer_module()
    raw = object()
    with pytest.raises(AttributeError, match="_inner_opt"):
        module.Trainer(raw)._wrap_distributed_optimizer(raw)  # the defect
    patcher = Patcher("test", "off")
    grad_norm_hook.fix(patcher, module)
    try:
        trainer = module.Trainer(raw)
        wrapped = trainer._wrap_distributed_optimizer(raw)
        assert wrapped._inner_opt._grad_clip._global_norm() == "logged"
        assert trainer.optimizer is raw  # restored after the call
    finally:
        patcher.revert()


def test_unverified_paddleformers_is_left_alone(monkeypatch):
    module = _trainer_module()
    stock = module.Trainer._wrap_distributed_optimizer
    monkeypatch.setattr(paddleformers_fixes, "_paddleformers_version", lambda: "9.9.0")
    patcher = Patcher("test", "off")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        paddleformers_fixes._fix_trainer(patcher, module)
    assert any("PaddleFormers 1.2.x, this is 9.9.0" in str(w.message) for w in seen), [str(w.message) for w in seen]
    assert not patcher.applied and module.Trainer._wrap_distributed_optimizer is stock
