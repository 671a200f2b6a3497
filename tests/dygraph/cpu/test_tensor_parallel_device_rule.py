"""The device rule in paddle_hybrid.dygraph.cpu.tensor_parallel, in one process: every replacement
hands a call that is not a dygraph call on a gloo group with a CPU tensor to Paddle's
original, unchanged.

Each Paddle function is first swapped for a recording fake, then the cpu component is
installed, so the fake is the "original" the replacement wraps.  A call with a group whose
process group is NCCL (by class name, which is what the rule reads) must reach the fake with
the same arguments; so must a gloo call with a tensor that is not in host memory.  The
controls show the same calls on a gloo group with a CPU tensor do not reach it (or reach it
changed, where the replacement's CPU work is to adjust Paddle's own call: the overlapped
linear without c_identity and unfused, the sequence-parallel all_gather on a dense copy).
"""
import inspect

import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig


class ProcessGroupNCCL:
    """Named like Paddle's NCCL process group; nothing else of it is needed."""


class ProcessGroupGloo:
    """Named like Paddle's gloo process group."""


class FakeGroup:
    def __init__(self, backend):
        self.process_group, self.id, self.rank, self.nranks = backend(), 7, 0, 2

    def is_member(self):
        return True


class DevicePlace:
    def is_cpu_place(self):
        return False


class DeviceTensor:
    """Stands for a tensor in device memory (no device exists on a CPU build)."""

    place = DevicePlace()
    shape = [2, 4]


class FakeHcg:
    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_group_src_rank(self):
        return 0


class Recorder:
    """A fake Paddle function: records each call's arguments by name, returns a sentinel."""

    def __init__(self, name, params):
        self.name, self.calls, self.sentinel = name, [], object()
        kinds = {"*": inspect.Parameter.VAR_POSITIONAL, "**": inspect.Parameter.VAR_KEYWORD}
        signature = inspect.Signature([
            inspect.Parameter(p.lstrip("*"), kinds.get(p[:len(p) - len(p.lstrip("*"))],
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD))
            for p in params])

        def fake(*args, **kwargs):
            return self._record(signature.bind(*args, **kwargs).arguments)

        fake.__signature__ = signature  # what the component's parameter check reads
        self.fn = fake

    def _record(self, arguments):
        call = dict(arguments)
        if "ctx" in call:  # the flag as the original saw it (the replacement may restore it)
            call["fused_flag"] = call["ctx"].mp_fused_linear_param_grad_add
        self.calls.append(call)
        return self.sentinel


def _owners():
    from paddle.distributed.fleet.layers.mpu import mp_layers, mp_ops
    from paddle.distributed.fleet.utils import hybrid_parallel_util
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    return mp_ops, mp_layers, hybrid_parallel_util, spu


OVERLAP_FORWARD = ["ctx", "x", "weight", "bias", "fuse_matmul_bias", "mp_async_allreduce", "mp_skip_c_identity",
                   "mp_fused_linear_param_grad_add", "model_parallel_group"]


SP_OVERLAP_FORWARD = ["ctx", "x", "weight", "bias", "fuse_matmul_bias", "recompute_allgather",
                      "mp_fused_linear_param_grad_add", "model_parallel_group"]


class Ctx:
    def __init__(self, group):
        self.model_parallel_group, self.mp_fused_linear_param_grad_add = group, True


@pytest.fixture
def fakes(fresh_plugin, monkeypatch):
    """{name: Recorder} installed as Paddle's functions, then the cpu component on top of them;
    the component is removed again before monkeypatch puts Paddle's functions back."""
    mp_ops, mp_layers, hpu, spu = _owners()
    table = {
        "_c_identity": (mp_ops, ["tensor", "group", "skip_c_identity_dynamic"]),
        "_mp_allreduce": (mp_ops, ["tensor", "op", "group", "use_calc_stream", "use_model_parallel",
                                   "skip_c_identity_dynamic"]),
        "_c_split": (mp_ops, ["tensor", "group"]),
        "_c_concat": (mp_ops, ["tensor", "group"]),
        "_c_softmax_with_cross_entropy": (mp_ops, ["logits", "label", "group", "return_softmax", "ignore_index"]),
        "broadcast_input_data": (hpu, ["hcg", "*inputs", "**kwargs"]),
    }
    recorders = {}
    for name, (owner, params) in table.items():
        recorders[name] = Recorder(name, params)
        monkeypatch.setattr(owner, name, recorders[name].fn)
    for key, cls, method, params in (("InnerOverlapLinear.forward", mp_layers.InnerOverlapLinear, "forward",
                                      OVERLAP_FORWARD),
                                     ("InnerOverlapLinear.backward", mp_layers.InnerOverlapLinear, "backward",
                                      ["ctx", "dy"]),
                                     ("SPInnerOverlapLinear.forward", spu.SPInnerOverlapLinear, "forward",
                                      SP_OVERLAP_FORWARD),
                                     ("SPInnerOverlapLinear.backward", spu.SPInnerOverlapLinear, "backward",
                                      ["ctx", "dy"])):
        recorders[key] = Recorder(key, params)
        monkeypatch.setattr(cls, method, staticmethod(recorders[key].fn))
    recorders["sp.all_gather"] = Recorder("sp.all_gather", ["input"])
    monkeypatch.setattr(spu, "all_gather", recorders["sp.all_gather"].fn)
    state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    assert state.status == "active", state.reason
    try:
        yield recorders
    finally:
        paddle_hybrid.uninstall_component("cpu")


def _calls(tensor, group, ctx=None):
    """name -> a call of the installed replacement with ``tensor`` on ``group``."""
    from paddle.distributed import fleet

    mp_ops, mp_layers, hpu, spu = _owners()
    ctx = ctx or Ctx(group)

    def sp_all_gather():  # its group is fleet's model-parallel group
        orig = fleet.get_hybrid_communicate_group
        fleet.get_hybrid_communicate_group = lambda: FakeHcg(group)
        try:
            return spu.all_gather(tensor)
        finally:
            fleet.get_hybrid_communicate_group = orig

    label = paddle.zeros([2, 1], dtype="int64")
    return {
        "_c_identity": lambda: mp_ops._c_identity(tensor, group=group),
        "_mp_allreduce": lambda: mp_ops._mp_allreduce(tensor, group=group),
        "_c_split": lambda: mp_ops._c_split(tensor, group=group),
        "_c_concat": lambda: mp_ops._c_concat(tensor, group=group),
        "_c_softmax_with_cross_entropy": lambda: mp_ops._c_softmax_with_cross_entropy(tensor, label, group=group),
        "broadcast_input_data": lambda: hpu.broadcast_input_data(FakeHcg(group), tensor),
        "InnerOverlapLinear.forward": lambda: mp_layers.InnerOverlapLinear.forward(
            ctx, tensor, None, None, False, True, False, False, group),
        "InnerOverlapLinear.backward": lambda: mp_layers.InnerOverlapLinear.backward(ctx, tensor),
        "SPInnerOverlapLinear.forward": lambda: spu.SPInnerOverlapLinear.forward(
            ctx, tensor, None, None, False, True, False, group),
        "SPInnerOverlapLinear.backward": lambda: spu.SPInnerOverlapLinear.backward(ctx, tensor),
        "sp.all_gather": sp_all_gather,
    }


def _reached(recorder, call):
    before = len(recorder.calls)
    out = call()
    return out is recorder.sentinel and len(recorder.calls) == before + 1


def test_a_nccl_group_reaches_paddles_original(fakes):
    tensor = paddle.ones([4, 2]).transpose([1, 0])  # strided: sp.all_gather must not copy it here
    group = FakeGroup(ProcessGroupNCCL)
    calls = _calls(tensor, group)
    assert set(calls) == set(fakes)
    missed = [name for name, call in calls.items() if not _reached(fakes[name], call)]
    assert not missed, f"not handed to Paddle's original on an NCCL group: {missed}"
    for name, recorder in fakes.items():
        args = recorder.calls[-1]
        assert args.get("group", args.get("model_parallel_group", group)) is group, name
    # unchanged: the overlapped linear keeps its c_identity, the backward its fused kernel
    assert fakes["InnerOverlapLinear.forward"].calls[-1]["mp_skip_c_identity"] is False
    for name in ("InnerOverlapLinear.backward", "SPInnerOverlapLinear.backward"):
        assert fakes[name].calls[-1]["fused_flag"] is True, name
    for name in ("sp.all_gather", "SPInnerOverlapLinear.forward"):
        args = fakes[name].calls[-1]
        assert args.get("input", args.get("x")) is tensor, f"{name} did not pass the strided tensor on as it was"


def test_a_device_tensor_on_gloo_reaches_paddles_original(fakes):
    calls = _calls(DeviceTensor(), FakeGroup(ProcessGroupGloo))
    # the input broadcast finds tensors by type; a stand-in is not one (covered above)
    del calls["broadcast_input_data"]
    missed = [name for name, call in calls.items() if not _reached(fakes[name], call)]
    assert not missed, f"not handed to Paddle's original with a device tensor: {missed}"


def test_control_gloo_and_cpu_is_handled_here(fakes):
    """The same calls on a gloo group with a CPU tensor: the ops whose forward needs no
    collective run the plugin's version (the fake is not called); the overlapped linear
    reaches Paddle's function with its CPU adjustment (no c_identity, unfused backward)."""
    tensor = paddle.ones([2, 4])
    group = FakeGroup(ProcessGroupGloo)
    calls = _calls(tensor, group)
    strided = paddle.ones([4, 2]).transpose([1, 0])
    for name, arg in (("sp.all_gather", "input"), ("SPInnerOverlapLinear.forward", "x")):
        assert _reached(fakes[name], _calls(strided, group)[name]), name
        dense = fakes[name].calls[-1][arg]
        assert dense is not strided and dense.is_contiguous() and (dense.numpy() == strided.numpy()).all(), name
        assert not strided.is_contiguous(), f"{name} re-laid the caller's tensor in place"
    for name in ("_c_identity", "_c_split"):
        out = calls[name]()
        assert out is not fakes[name].sentinel and not fakes[name].calls, name
    calls["InnerOverlapLinear.forward"]()
    assert fakes["InnerOverlapLinear.forward"].calls[-1]["mp_skip_c_identity"] is True
    ctx = Ctx(group)
    calls = _calls(tensor, group, ctx)
    for name in ("InnerOverlapLinear.backward", "SPInnerOverlapLinear.backward"):
        assert _reached(fakes[name], calls[name]), name
        assert fakes[name].calls[-1]["fused_flag"] is False, name
        assert ctx.mp_fused_linear_param_grad_add is True, f"{name} left the context changed"
