"""The device rule of ``paddle_hybrid.dygraph.cpu.sharding``: every replacement decides per call and hands
a call that is not on the CPU (a non-CPU place, a "gpu" storage, a run on a GPU, a non-gloo
group) to Paddle's original unchanged.

Paddle's originals are replaced by recording fakes *before* the cpu component is installed, so
the plugin wraps the fakes; each test then calls the plugin's replacement and checks whether the
fake (standing for Paddle's original) was reached, and with which arguments.  A GPU run is
simulated by ``paddle.get_device()`` answering ``"gpu:0"`` and a non-gloo group by an object
whose ``process_group`` is of a class named ``ProcessGroupNCCL``.

Seen failing first: on the code before the rule (commit a51022a), the module views answered
"CPU accepted" on a simulated GPU run (``is_compiled_with_cuda`` True, "cpu" a custom device
type), and the clip took the CPU path for a non-gloo group.
"""
import types

import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig


def _group(backend_class):
    return types.SimpleNamespace(process_group=type(backend_class, (), {})(), nranks=2, rank=0)


GLOO, NCCL = _group("ProcessGroupGloo"), _group("ProcessGroupNCCL")


class Device:
    """What ``paddle.get_device()`` answers: ``"cpu"`` unless a test says ``"gpu:0"``."""

    def __init__(self):
        self.name = "cpu"

    def __call__(self):
        return self.name


@pytest.fixture
def fakes(fresh_plugin, monkeypatch):
    """Recording fakes in place of Paddle's originals, then the cpu component installed on top
    (uninstalled before the originals come back)."""
    from paddle.base import core
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_optimizer_stage2 as gso2
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage2 as gs2
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as gs3
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_storage as storage
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_utils as gsu
    from paddle.distributed.fleet.utils import tensor_fusion_helper as tfh
    from paddle.distributed.sharding import group_sharded as gs

    calls = []
    device = Device()
    monkeypatch.setattr(paddle, "get_device", device)

    def get_current_device_type():
        calls.append(("get_current_device_type",))
        return "stock"

    def add_rank_params(self, trainable_params, param2align, convert_gpu=True):
        calls.append(("add_rank_params", convert_gpu))

    def init(self, layer, group=None, device="gpu"):
        calls.append((type(self).__name__, device))

    def _dygraph_clip(self, params_grads):
        calls.append(("_dygraph_clip", params_grads))
        return params_grads

    def is_compiled_with_cuda():
        calls.append(("is_compiled_with_cuda",))
        return False

    def get_all_custom_device_type():
        return ["npu"]

    monkeypatch.setattr(tfh, "get_current_device_type", get_current_device_type)
    monkeypatch.setattr(storage.ParamStorage, "add_rank_params", add_rank_params)
    for cls in (gso2.GroupShardedOptimizerStage2, gs2.GroupShardedStage2, gs3.GroupShardedStage3):
        monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(gsu.GroupShardedClipGrad, "_dygraph_clip", _dygraph_clip)
    monkeypatch.setattr(core, "is_compiled_with_cuda", is_compiled_with_cuda)
    monkeypatch.setattr(paddle.device, "get_all_custom_device_type", get_all_custom_device_type)
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    calls.clear()  # what the gate asked the (faked) build while installing: not a replacement's call
    yield types.SimpleNamespace(calls=calls, device=device, tfh=tfh, storage=storage, gsu=gsu, gs=gs, gso2=gso2,
                                gs3=gs3, classes=(gso2.GroupShardedOptimizerStage2, gs2.GroupShardedStage2,
                                                  gs3.GroupShardedStage3))
    paddle_hybrid.uninstall_component("cpu")


def test_device_type_of_a_non_cpu_place_is_paddles(fakes, monkeypatch):
    monkeypatch.setattr(fakes.tfh, "_current_expected_place_", lambda: object())  # not a CPUPlace
    assert fakes.tfh.get_current_device_type() == "stock"
    assert fakes.calls == [("get_current_device_type",)]
    fakes.calls.clear()
    monkeypatch.setattr(fakes.tfh, "_current_expected_place_", lambda: paddle.CPUPlace())
    assert fakes.tfh.get_current_device_type() == "cpu" and fakes.calls == []


def test_storage_converts_unless_it_is_a_cpu_storage_on_the_cpu(fakes):
    cpu_buffer = paddle.zeros([4])
    for device, expected in (("gpu", True), ("xpu", True), ("cpu", False)):
        store = types.SimpleNamespace(_device=device, buffer=cpu_buffer)
        fakes.storage.ParamStorage.add_rank_params(store, [], {})
        assert fakes.calls.pop() == ("add_rank_params", expected), device
    # a "cpu" storage whose buffer is not on the CPU: Paddle's call as made
    store = types.SimpleNamespace(_device="cpu", buffer=object())
    fakes.storage.ParamStorage.add_rank_params(store, [], {}, True)
    assert fakes.calls.pop() == ("add_rank_params", True)


def test_group_sharded_default_device_only_for_a_cpu_run_over_gloo(fakes):
    for cls in fakes.classes:
        obj = cls.__new__(cls)
        cls.__init__(obj, None, group=GLOO)  # CPU run, gloo group, no device named: cpu
        assert fakes.calls.pop() == (cls.__name__, "cpu")
        cls.__init__(obj, None, group=NCCL)  # not gloo: Paddle's default
        assert fakes.calls.pop() == (cls.__name__, "gpu")
        cls.__init__(obj, None, GLOO, "xpu")  # named by the caller (positionally): kept
        assert fakes.calls.pop() == (cls.__name__, "xpu")
        fakes.device.name = "gpu:0"  # a GPU run
        cls.__init__(obj, None, group=GLOO)
        assert fakes.calls.pop() == (cls.__name__, "gpu")
        fakes.device.name = "cpu"


def test_module_views_accept_cpu_only_while_the_run_is_on_cpu(fakes):
    views = (fakes.gso2.core, fakes.gs3.core)
    assert all(v.is_compiled_with_cuda() for v in views) and fakes.calls == []
    assert fakes.gs.paddle.device.get_all_custom_device_type() == ["npu", "cpu"]
    assert fakes.gso2.paddle.get_device() == "cpu:0"
    fakes.device.name = "gpu:0"
    assert not any(v.is_compiled_with_cuda() for v in views)  # Paddle's own answer ...
    assert fakes.calls == [("is_compiled_with_cuda",)] * 2    # ... asked of Paddle
    assert fakes.gs.paddle.device.get_all_custom_device_type() == ["npu"]
    assert fakes.gso2.paddle.get_device() == "gpu:0"


def test_clip_of_a_non_cpu_device_or_group_is_paddles(fakes):
    params_grads = [("p", "g")]
    for device, group in (("gpu:0", GLOO), ("cpu", NCCL), ("cpu:0", NCCL)):
        clip = types.SimpleNamespace(_device=device, _group=group)
        assert fakes.gsu.GroupShardedClipGrad._dygraph_clip(clip, params_grads) is params_grads
        assert fakes.calls.pop() == ("_dygraph_clip", params_grads), (device, group)
