"""One attribute, two owners: the fleet fixes and the gradient buckets both wrap
``HybridParallelOptimizer._hybrid_sync_grad``.  Removing either, in either order, leaves the
other acting (checked on gradient values), and reinstalling stacks them again.  The timeline's
hooks go through the registry: ``uninstall()`` restores every Paddle attribute."""
import numpy as np
import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.catalog import install as _install
from paddle_hybrid.dygraph.fleet_fixes.no_pipeline_dp import MARK
from paddle_hybrid.registry.patching import Patcher, PatchConflictError


def _hpo():
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )
    return HybridParallelOptimizer


@pytest.fixture
def sync_grad_fakes(monkeypatch):
    """Paddle's ``_hybrid_sync_grad`` and what each wrapper calls, replaced by fakes that change
    gradients by a value of their own: Paddle's sync adds 1, the fleet fix's all-reduce of the
    marked parameters adds 10, the buckets' finish adds 100.  The plugin is reinstalled on top
    of the fake original, and restored afterwards."""
    from paddle.distributed.fleet.utils import hybrid_parallel_util

    from paddle_hybrid.dygraph.grad_buckets import wiring

    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    param = paddle.create_parameter([3], "float32")
    param.grad_value = np.zeros(3, np.float32)  # the fakes change this array
    setattr(param, MARK, True)

    def paddle_sync(self, parameter_list):
        for p in parameter_list:
            p.grad_value += 1

    def fused_allreduce_gradients(params, hcg):
        for p in params:
            p.grad_value += 10

    class FakeBucketSet:
        def finish_grad_sync(self):
            param.grad_value += 100

    monkeypatch.setattr(_hpo(), "_hybrid_sync_grad", paddle_sync)
    monkeypatch.setattr(hybrid_parallel_util, "fused_allreduce_gradients", fused_allreduce_gradients)
    # one bucket set, and every parameter also left to Paddle's sync (so both wrappers always act)
    monkeypatch.setattr(wiring, "buckets_for_params", lambda params: ([FakeBucketSet()], list(params)))
    yield param, paddle_sync
    paddle_hybrid.uninstall()
    monkeypatch.undo()
    paddle_hybrid.install(config)


def _sync_once(param):
    class Optimizer:  # the mode in which the fleet fix acts
        _use_dp_mode, _need_dp, _hcg = True, True, None

    param.grad_value[:] = 0
    _hpo()._hybrid_sync_grad(Optimizer(), [param])
    return float(param.grad_value[0])


def _fix_wraps_sync_grad() -> bool:
    # Paddle 3.2 has no NoPipelineParallel: the fix has nothing to do there and wraps nothing.
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel

    return hasattr(pipeline_parallel, "NoPipelineParallel")


FIX = 10.0 if _fix_wraps_sync_grad() else 0.0
BOTH, FIX_ONLY, BUCKETS_ONLY, NEITHER = 101.0 + FIX, 1.0 + FIX, 101.0, 1.0


@pytest.mark.parametrize("first_out", ["fleet_fixes", "grad_buckets"])
def test_either_owner_can_go_first(sync_grad_fakes, first_out):
    param, paddle_sync = sync_grad_fakes
    config = PluginConfig(cpu="off")
    paddle_hybrid.install_component("fleet_fixes", config)
    paddle_hybrid.install_component("grad_buckets", config)
    assert _sync_once(param) == BOTH

    paddle_hybrid.uninstall_component(first_out)
    assert _sync_once(param) == (BUCKETS_ONLY if first_out == "fleet_fixes" else FIX_ONLY)
    paddle_hybrid.install_component(first_out, config)  # back, now on top of the other
    assert _sync_once(param) == BOTH

    other = "grad_buckets" if first_out == "fleet_fixes" else "fleet_fixes"
    paddle_hybrid.uninstall_component(other)
    assert _sync_once(param) == (FIX_ONLY if first_out == "fleet_fixes" else BUCKETS_ONLY)
    paddle_hybrid.uninstall_component(first_out)
    assert _sync_once(param) == NEITHER
    assert vars(_hpo())["_hybrid_sync_grad"] is paddle_sync  # Paddle's, by identity


def test_a_value_that_cannot_be_spliced_is_refused():
    class Owner:
        value = 1

    lower, upper = Patcher("lower", "LOWER=0"), Patcher("upper", "UPPER=0")
    lower.set(Owner, "value", 2)
    upper.set(Owner, "value", 3)
    with pytest.raises(RuntimeError, match="was replaced again after this component replaced it"):
        lower.revert()
    assert Owner.value == 3
    try:
        lower._undo(Owner, "value", 1, 2)
    except PatchConflictError as exc:
        assert "undo the later change first" in str(exc)
    else:
        raise AssertionError("no PatchConflictError")


def _timeline_targets():
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel as pp
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import PipelineLayer
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    hpo = _hpo()
    return [vars(pp.PipelineParallel)["train_batch"], vars(pp.PipelineParallelWithInterleave)["train_batch"],
            vars(pp.PipelineParallel)["_forward_step"], vars(pp.PipelineParallel)["_backward_step"],
            p2p._p2p_helper, vars(PipelineLayer)["allreduce_shared_weight_gradients"], vars(hpo)["step"],
            vars(hpo)["_step"]]


def test_timeline_enable_then_uninstall_restores_everything():
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall()
    stock = _timeline_targets()
    try:
        paddle_hybrid.install(config)
        installed = {(e["owner"], e["name"]) for e in paddle_hybrid.patches()}
        paddle_hybrid.dygraph.timeline.enable()
        added = {(e["owner"], e["name"]) for e in paddle_hybrid.patches() if e["component"] == "timeline"}
        assert len(added) == 8 and paddle_hybrid.dygraph.timeline.is_enabled()
        assert all(now is not before for now, before in zip(_timeline_targets(), stock))
        paddle_hybrid.uninstall()
        assert paddle_hybrid.patches() == [] and not paddle_hybrid.dygraph.timeline.is_enabled()
        assert all(now is before for now, before in zip(_timeline_targets(), stock))
        assert installed  # the rest of the plugin was there too, and went with it
    finally:
        paddle_hybrid.uninstall()
        paddle_hybrid.install(config)
    assert not paddle_hybrid.dygraph.timeline.is_enabled()
