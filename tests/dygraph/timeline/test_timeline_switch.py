"""The timeline is off by default, turned on by the config / environment or enable(), and
removes every hook when turned off."""
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph import timeline


def _targets():
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
        HybridParallelOptimizer,
    )
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel as pp
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import PipelineLayer
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    return [vars(pp.PipelineParallel)["train_batch"], vars(pp.PipelineParallelWithInterleave)["train_batch"],
            pp.PipelineParallel._forward_step, pp.PipelineParallel._backward_step, p2p._p2p_helper,
            PipelineLayer.allreduce_shared_weight_gradients, HybridParallelOptimizer.step,
            HybridParallelOptimizer._step]


def test_off_by_default_on_by_config_and_env(monkeypatch):
    assert PluginConfig().timeline is False and not timeline.is_enabled()
    stock = _targets()
    try:
        paddle_hybrid.install_component("timeline", PluginConfig(timeline=True))
        assert timeline.is_enabled()
        assert all(now is not before for now, before in zip(_targets(), stock))
    finally:
        paddle_hybrid.uninstall_component("timeline")
    assert _targets() == stock and not timeline.is_enabled()
    monkeypatch.setenv("PADDLE_HYBRID_TIMELINE", "1")
    assert PluginConfig.from_env().timeline is True


def test_nothing_recorded_outside_train_batch():
    from paddle_hybrid.dygraph.timeline.recorder import Recorder

    rec = Recorder()
    with rec.span("forward", "F", micro=0):
        pass
    assert rec.events == []  # no step open
    rec.begin_step(rank=3)
    with rec.span("forward", "F", micro=0):
        pass
    assert not rec.begin_step(rank=3)  # a nested train_batch does not open a second step
    rec.end_step()
    assert [(e["rank"], e["step"], e["cat"], e["micro"]) for e in rec.events] == [(3, 0, "forward", 0)]
    assert rec.events[0]["end"] >= rec.events[0]["start"] and rec.step == 1


def test_unverified_paddle_refused(monkeypatch):
    import warnings

    import paddle
    import pytest

    monkeypatch.setattr(paddle, "__version__", "9.9.0")
    with pytest.raises(RuntimeError, match="verified on Paddle 3.2.x/3.3.x, this is 9.9.0; not recording"):
        timeline.enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = paddle_hybrid.install_component("timeline", PluginConfig(timeline=True))
    assert any("9.9.0; skipped. Set PADDLE_HYBRID_FORCE=timeline" in str(w.message) for w in caught)
    assert state.status == "skipped" and not timeline.is_enabled()
    state = paddle_hybrid.install_component("timeline", PluginConfig(timeline=True, force_unverified=("timeline",)))
    try:
        assert state.status == "active" and timeline.is_enabled()
    finally:
        paddle_hybrid.uninstall_component("timeline")
    assert not timeline.is_enabled()
