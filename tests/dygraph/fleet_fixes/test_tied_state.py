"""A tied weight's optimizer state in a flex checkpoint, one process: saved under each of the
weight's names (``fleet_fixes.tied_optimizer_state``), so a model that holds the weight under its
second name only (as a pipeline stage does) finds its Adam moments; a checkpoint saved without
the fix makes that load raise instead of logging "Missing keys" and leaving the moments at zero."""
import numpy as np
import pytest

import paddle
import paddle.distributed as dist
import paddle_hybrid
from paddle_hybrid.dygraph.fleet_fixes.tied_optimizer_state import MissingOptimizerStateError


class Tied(paddle.nn.Layer):
    """One parameter under two names: ``a.weight`` (the first in sorted order) and ``b.weight``."""

    def __init__(self):
        super().__init__()
        self.a = paddle.nn.Linear(4, 4, bias_attr=False)
        self.b = paddle.nn.Layer()
        self.b.weight = self.a.weight

    def forward(self, x):
        return paddle.matmul(self.a(x), self.b.weight)


class SecondNameOnly(paddle.nn.Layer):
    """The weight as a later pipeline stage holds it: under ``b.weight`` only."""

    def __init__(self):
        super().__init__()
        self.b = paddle.nn.Linear(4, 4, bias_attr=False)


def _trained_tied():
    paddle.seed(3)
    model = Tied()
    opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters())
    model(paddle.ones([2, 4])).sum().backward()
    opt.step()
    return model, opt


def _load_into_second_name(path):
    model = SecondNameOnly()
    opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters())
    opt._create_accumulators(paddle.base.framework.default_main_program().global_block(), model.parameters())
    target = opt.sharded_state_dict(model.sharded_state_dict())
    dist.load_state_dict(target, path)
    return {k: v.local_tensor.numpy() for k, v in target.items()}


@pytest.fixture
def fleet_fixes_off():
    paddle_hybrid.uninstall_component("fleet_fixes")
    yield
    paddle_hybrid.install_component("fleet_fixes")


def test_second_name_finds_the_state(tmp_path):
    model, opt = _trained_tied()
    saved = opt.sharded_state_dict(model.sharded_state_dict())
    assert {"a.weight.moment1_0", "b.weight.moment1_0"} <= set(saved), sorted(saved)
    dist.save_state_dict(saved, str(tmp_path))
    loaded = _load_into_second_name(str(tmp_path))
    moment = saved["a.weight.moment1_0"].local_tensor.numpy()
    assert np.abs(moment).max() > 0
    np.testing.assert_array_equal(loaded["b.weight.moment1_0"], moment)


def test_checkpoint_without_the_second_name_raises(tmp_path, fleet_fixes_off):
    model, opt = _trained_tied()
    saved = opt.sharded_state_dict(model.sharded_state_dict())
    assert "b.weight.moment1_0" not in saved  # stock Paddle: the first name only
    dist.save_state_dict(saved, str(tmp_path))
    paddle_hybrid.install_component("fleet_fixes")
    with pytest.raises(MissingOptimizerStateError, match="b.weight.moment1_0"):
        _load_into_second_name(str(tmp_path))
