"""The device rule of the expert-parallel replacements, without processes: a tensor that is not
on the CPU, or a group that is not gloo, reaches Paddle's original (a recording fake installed
before the component, so the plugin wraps the fake); a CPU build with ``auto`` installs them,
an accelerator build does not unless ``on``."""
import importlib

import numpy as np
import paddle
import pytest

import paddle_hybrid
from paddle_hybrid.catalog import install as _install
from paddle_hybrid.config import PluginConfig
from paddle_hybrid.gloo import all_to_all
from paddle_hybrid.registry.gate import decide


class FakeTensor:
    """A tensor somewhere other than host memory."""

    class place:
        @staticmethod
        def is_cpu_place():
            return False


class Recorder:
    def __init__(self, result="original"):
        self.calls, self.result = [], result

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def test_every_gloo_method_hands_a_device_tensor_to_paddle():
    for name, (run, tensors_of) in all_to_all.PATCHED_METHODS.items():
        original = Recorder()
        method = all_to_all._make(original, run, tensors_of)
        args = {"all_to_all": ([FakeTensor()], [FakeTensor()], True),
                "all_to_all_on_calc_stream": ([FakeTensor()], [FakeTensor()]),
                "all_to_all_tensor": (FakeTensor(), FakeTensor(), True),
                "all_to_all_tensor_on_calc_stream": (FakeTensor(), FakeTensor()),
                "all_to_all_single": (FakeTensor(), FakeTensor(), [], [], True),
                "all_to_all_single_on_calc_stream": (FakeTensor(), FakeTensor(), [], []),
                "alltoall": (FakeTensor(), FakeTensor()),
                "alltoall_single": (FakeTensor(), FakeTensor(), [], [])}[name]
        pg = object()
        assert method(pg, *args) == "original", name
        assert original.calls == [(pg,) + args], name


def test_only_the_gloo_class_is_patched():
    from paddle.base import core

    names = set(all_to_all.PATCHED_METHODS)
    assert names <= set(vars(core.ProcessGroupGloo))  # the plugin's, on the gloo class
    assert not any(getattr(vars(core.ProcessGroup).get(n), "_ph_link_cell", None) for n in names)


def _reinstall_with_fakes(monkeypatch, fakes):
    """Uninstall, put recording fakes where the component will wrap them, install again."""
    paddle_hybrid.uninstall()
    for (module, name), fake in fakes.items():
        monkeypatch.setattr(importlib.import_module(module), name, fake)
    paddle_hybrid.install(PluginConfig.from_env())


@pytest.fixture
def plugin_reinstalled():
    yield
    paddle_hybrid.uninstall()
    paddle_hybrid.install(PluginConfig.from_env())


def test_routing_kernels_and_global_exchange_hand_other_calls_to_paddle(plugin_reinstalled, monkeypatch):
    # plugin_reinstalled first: it is torn down last, after monkeypatch has put Paddle's functions back
    utils = "paddle.distributed.models.moe.utils"
    moe_utils = "paddle.distributed.utils.moe_utils"
    count = Recorder("number_count")
    scatter = Recorder("global_scatter")
    count_fake = lambda numbers, upper_range: count(numbers, upper_range)  # noqa: E731
    scatter_fake = lambda x, local_count, global_count, group=None, use_calc_stream=True: \
        scatter(x, local_count, global_count, group, use_calc_stream)  # noqa: E731
    _reinstall_with_fakes(monkeypatch, {(utils, "_number_count"): count_fake,
                                        (moe_utils, "global_scatter"): scatter_fake})
    numbers = importlib.import_module(utils)
    # a static program (not dygraph) goes to Paddle
    paddle.enable_static()
    try:
        assert numbers._number_count("a variable", 4) == "number_count"
    finally:
        paddle.disable_static()
    # a CPU tensor in dygraph takes the CPU kernel
    np.testing.assert_array_equal(numbers._number_count(paddle.to_tensor([0, 2, 2], dtype="int64"), 3).numpy(),
                                  [1, 0, 2])
    assert len(count.calls) == 1

    class NotGloo:  # a group whose process group is not gloo (the class name decides)
        nranks = 2

        def is_member(self):
            return True

        class process_group:
            pass

    x = paddle.zeros([2, 3])
    counts = paddle.to_tensor([1, 1], dtype="int64")
    assert importlib.import_module(moe_utils).global_scatter(x, counts, counts, group=NotGloo()) == "global_scatter"
    assert len(scatter.calls) == 1


@pytest.mark.parametrize("accelerator,setting,installed", [
    (None, "auto", True), ("cuda", "auto", False), ("cuda", "on", True), (None, "off", False)])
def test_gate(monkeypatch, accelerator, setting, installed):
    import paddle_hybrid.registry.device as device

    monkeypatch.setattr(device, "accelerator_build", lambda: accelerator)
    decision = decide(PluginConfig(expert_parallel=setting), "expert_parallel")
    assert decision.on == installed, decision.reason
    if accelerator and not installed:
        assert "PADDLE_HYBRID_EXPERT_PARALLEL=on" in decision.reason


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="PADDLE_HYBRID_EXPERT_PARALLEL"):
        PluginConfig(expert_parallel="yes")


def test_installed_and_undone_by_the_registry():
    state = _install.component_state("expert_parallel")
    assert state is not None and state.status == "active"
    owners = {getattr(o, "__name__", str(o)) for o, _ in state.patcher.patched()}
    assert "ProcessGroupGloo" in owners
