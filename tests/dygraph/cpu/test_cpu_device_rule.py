"""The device rule for paddle_hybrid.dygraph.cpu (README, "The device rule").

* Under ``cpu="auto"`` nothing of the CPU support installs on a build with an
  accelerator: CUDA, XPU and a custom device are faked by replacing
  ``paddle.is_compiled_with_cuda`` / ``is_compiled_with_xpu`` /
  ``paddle.device.get_all_custom_device_type``.
* Under ``cpu="on"`` every replacement of the concerns device, groups, p2p,
  collectives, recompute, timers and virtual_pipeline hands a call on a non-gloo group
  (a fake whose ``process_group`` is a ``ProcessGroupNCCL``), a tensor not in host memory
  (a fake) or a run not on the CPU (``paddle.get_device`` answering ``"gpu:0"``) to Paddle's
  original, unchanged.  "Paddle's original" is a recording fake put in place of it *before*
  the component installs, so the replacement captured the fake as the function it wraps.
  A completeness test makes sure every attribute those concerns replace has such a fake.
* On a CPU run recompute_hybrid's forward is Paddle's own, only its device gate answered
  for the CPU; its partition split leaves the caller's activation alone.
* The two-stage virtual pipeline lift is refused, with a warning, when Paddle's source
  cannot be read.

Every test leaves the plugin installed as it was (``fresh_plugin``); fakes of Paddle
attributes are removed only after the component that wrapped them is uninstalled.
"""
import contextlib
import importlib

import numpy as np
import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph import cpu
from paddle_hybrid.gloo import groups

_MISSING = object()
_GATE = "Recompute with RNG is not support current device"
_VP_CHECK = "virtual pipeline must run under pp degree > 2"


# ---------------------------------------------------------------------------
# fakes
# ---------------------------------------------------------------------------

class ProcessGroupNCCL:
    """Named like Paddle's NCCL process group: all the plugin looks at is the class name."""


class ProcessGroupGloo:
    """Named like Paddle's gloo process group."""


class _Group:
    """What the plugin reads of a ``paddle.distributed`` group."""

    def __init__(self, process_group, nranks=2, rank=0):
        self.process_group, self.nranks, self.rank, self.id = process_group, nranks, rank, 7


def _nccl_group():
    return _Group(ProcessGroupNCCL())


def _gloo_group():
    return _Group(ProcessGroupGloo())


class _DevicePlace:
    def is_cpu_place(self):
        return False


class _DeviceTensor:
    """A tensor in device memory, as far as ``paddle_hybrid.registry.device.on_cpu`` can tell."""

    place = _DevicePlace()
    shape = [4, 2]


class _Hcg:
    """A hybrid communicate group whose pipeline group is ``pipe_group``.  It also carries a
    pair group for peer 1, so a replacement that wrongly took the gloo path would visibly send
    through ``"pair group"`` instead of ``pipe_group``."""

    def __init__(self, pipe_group):
        self.pipe_group = pipe_group
        setattr(self, groups.PAIR_GROUPS_ATTR, {1: "pair group"})

    def get_pipe_parallel_group(self):
        return self.pipe_group

    def _get_p2p_prev_rank(self):
        return 1

    def _get_p2p_next_rank(self):
        return 1

    def get_stage_id(self):
        return 0


class _Calls(list):
    """Calls seen by the recording fakes: ``(fake name, arguments)``."""

    def of(self, name):
        return [args for n, args in self if n == name]


def _value(owner, name):
    return vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)


def _cpu_targets():
    """``(owner, name)`` of every Paddle attribute the cpu component replaces under ``on``."""
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    try:
        return cpu.patched()
    finally:
        paddle_hybrid.uninstall_component("cpu")


@contextlib.contextmanager
def _installed_over(monkeypatch, fakes):
    """Put each ``(owner, name, fake)`` in place of Paddle's attribute, install the cpu component
    with ``cpu="on"`` (so it wraps the fakes), and afterwards uninstall it *before* the
    fakes are removed (the other order would leave the fakes behind)."""
    with monkeypatch.context() as mp:
        for owner, name, fake in fakes:
            mp.setattr(owner, name, fake)
        paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
        try:
            yield mp
        finally:
            paddle_hybrid.uninstall_component("cpu")


def _modules():
    import paddle.distributed.collective as collective
    import paddle.distributed.parallel as parallel
    from paddle.distributed.fleet.base import topology
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    return {
        "collective": collective,
        "parallel": parallel,
        "topology": topology,
        "pipeline_parallel": pipeline_parallel,
        "p2p": p2p,
        "reduce_scatter": importlib.import_module("paddle.distributed.communication.stream.reduce_scatter"),
        "recompute_hybrid": importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid"),
        "timer_helper": importlib.import_module("paddle.distributed.fleet.utils.timer_helper"),
    }


# ---------------------------------------------------------------------------
# auto: nothing on an accelerator build
# ---------------------------------------------------------------------------

_BUILDS = {
    "cuda": dict(cuda=True, xpu=False, custom=None, named="never run on cuda:"),
    "xpu": dict(cuda=False, xpu=True, custom=None, named="never run on xpu:"),
    "custom": dict(cuda=False, xpu=False, custom=["npu"], named="never run on custom:npu:"),
}


def _fake_build(mp, kind):
    build = _BUILDS[kind]
    mp.setattr(paddle, "is_compiled_with_cuda", lambda: build["cuda"])
    mp.setattr(paddle, "is_compiled_with_xpu", lambda: build["xpu"])
    mp.setattr(paddle.device, "get_all_custom_device_type", lambda: build["custom"])


@pytest.mark.parametrize("kind", sorted(_BUILDS))
def test_auto_installs_nothing_on_an_accelerator_build(fresh_plugin, monkeypatch, kind):
    targets = _cpu_targets()
    stock = [_value(owner, name) for owner, name in targets]
    with monkeypatch.context() as mp:
        _fake_build(mp, kind)
        state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="auto"))
        assert state.status == "off", state
        # The message names the accelerator and the switch that forces the CPU support.
        assert _BUILDS[kind]["named"] in state.reason and "cpu='on'" in state.reason, state.reason
        assert not cpu.is_active()
        assert [p for p in paddle_hybrid.patches() if p["component"] == "cpu"] == []
        assert [_value(owner, name) for owner, name in targets] == stock
        for (owner, name), original in zip(targets, stock):
            assert _value(owner, name) is original, (owner, name)
        # What the message promises: "on" installs them on this build.
        state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
        assert state.status == "active"
        assert {(id(o), n) for o, n in cpu.patched()} == {(id(o), n) for o, n in targets}
        paddle_hybrid.uninstall_component("cpu")


def test_auto_installs_on_a_build_without_accelerator(fresh_plugin, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(paddle, "is_compiled_with_cuda", lambda: False)
        mp.setattr(paddle, "is_compiled_with_xpu", lambda: False)
        mp.setattr(paddle.device, "get_all_custom_device_type", lambda: None)
        state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="auto"))
        assert state.status == "active" and cpu.is_active()


# ---------------------------------------------------------------------------
# on: every replacement hands other groups, tensors and devices to Paddle's original
# ---------------------------------------------------------------------------

def _recording_fakes(calls):
    """A fake with the parameters of each Paddle function the concerns replace; each records its
    arguments and returns a marker naming itself."""
    m = _modules()

    def record(name, *args):
        calls.append((name, args))
        return f"original {name}"

    def new_pg_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0,
                    nccl_comm_init_option=0, nccl_config=None):
        return record("new_pg_impl", backend, store, rank, world_size, group_name, pg_options, group_id)

    def hcg_init(self, topology, hybrid_configs):
        # What the stock constructor leaves that the pair-group code reads.
        self._pp_degree, self.global_rank, self._pp_comm_group = 2, 0, _nccl_group()
        self._topo = _Topo([[0, 1]])
        record("hcg_init", self, topology, hybrid_configs)

    def p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
        return record("p2p_ops", tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg)

    def batched_p2p_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, hcg):
        return record("batched_p2p_ops", tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                      hcg)

    def send_meta(self, tensor, group, reverse=False, broadcast=False):
        return record("send_meta", self, tensor, group, reverse, broadcast)

    def recv_meta(self, group, reverse=False, broadcast=False):
        return record("recv_meta", self, group, reverse, broadcast)

    def rs_tensor(out_tensor, in_tensor, op, group, sync_op, use_calc_stream, caller="reduce_scatter"):
        return record("rs_tensor", out_tensor, in_tensor, op, group, sync_op, use_calc_stream, caller)

    def rs_list(tensor, tensor_list, op, group, sync_op, use_calc_stream):
        return record("rs_list", tensor, tensor_list, op, group, sync_op, use_calc_stream)

    def split_activation(tensor, mp_group):
        return record("split_activation", tensor, mp_group)

    def merge_activation(tensor, mp_group):
        return record("merge_activation", tensor, mp_group)

    def timer_start(self):
        return record("timer_start", self)

    def timer_stop(self):
        return record("timer_stop", self)

    def interleave_check(self):
        """Stands for Paddle's check, which holds "virtual pipeline must run under pp degree > 2"."""
        return record("interleave_check", self)

    def fthenb_check(self):
        """Stands for Paddle's check, which holds "virtual pipeline must run under pp degree > 2"."""
        return record("fthenb_check", self)

    def device_id(self):
        return record("device_id", self)

    p2p, pp = m["p2p"], m["pipeline_parallel"]
    return [
        (m["collective"], "_new_process_group_impl", new_pg_impl),
        (m["topology"].HybridCommunicateGroup, "__init__", hcg_init),
        (p2p, "_p2p_ops", p2p_ops),
        (p2p, "_batched_p2p_ops", batched_p2p_ops),
        (p2p.SendRecvMeta, "send_meta", send_meta),
        (p2p.SendRecvMeta, "recv_meta", recv_meta),
        (m["reduce_scatter"], "_reduce_scatter_tensor_in_dygraph", rs_tensor),
        (m["reduce_scatter"], "_reduce_scatter_in_dygraph", rs_list),
        (m["recompute_hybrid"]._HPRecomputeFunction, "forward", staticmethod(_recording_forward(calls))),
        (m["recompute_hybrid"], "_split_activation", split_activation),
        (m["recompute_hybrid"], "_merge_activation", merge_activation),
        (m["timer_helper"]._Timer, "start", timer_start),
        (m["timer_helper"]._Timer, "stop", timer_stop),
        (pp.PipelineParallelWithInterleave, "_check_sanity", interleave_check),
        (pp.PipelineParallelWithInterleaveFthenB, "_check_sanity", fthenb_check),
        (m["parallel"].ParallelEnv, "device_id", property(device_id)),
    ]


# The concerns this file covers, in the component's order (tensor_parallel and sharding have
# their own device-rule tests).
_COVERED_CONCERNS = ["paddle_hybrid.dygraph.cpu.device_id", "paddle_hybrid.gloo.groups", "paddle_hybrid.dygraph.cpu.p2p",
                     "paddle_hybrid.gloo.kernels", "paddle_hybrid.dygraph.cpu.recompute",
                     "paddle_hybrid.dygraph.cpu.timers", "paddle_hybrid.dygraph.cpu.virtual_pipeline"]


def test_every_replacement_of_the_covered_concerns_has_a_recording_fake(fresh_plugin):
    """The tests below reach each replaced attribute through its fake: a replacement added to one
    of these concerns without a fake here fails this test."""
    from paddle_hybrid.registry.patching import Patcher

    patcher = Patcher("test", "none")
    try:
        for name in _COVERED_CONCERNS:
            importlib.import_module(name).apply(PluginConfig(), patcher)
        from paddle_hybrid.registry.patching import DeviceAnswers

        changes = patcher.changes()
        replaced = {(id(owner), name) for owner, name, _, value in changes if not isinstance(value, DeviceAnswers)}
        answered = {(owner.__name__, name) for owner, name, _, value in changes if isinstance(value, DeviceAnswers)}
    finally:
        patcher.revert()
    faked = {(id(owner), name) for owner, name, _ in _recording_fakes(_Calls())}
    assert replaced == faked
    # the one device answer among them: the recompute module's paddle (its forward's gate)
    assert answered == {("paddle.distributed.fleet.recompute.recompute_hybrid", "paddle")}


def _recording_forward(calls):
    def forward(ctx, run_function, all_outputs, mp_group, offload, partition, custom_get_state_func,
                custom_set_state_func, *args, **kwargs):
        """Stands for Paddle's forward (its code holds the gate's message, as Paddle's does).
        Records what it was called with, the custom device types its own body sees (through the
        ``paddle`` of its module, as Paddle's forward reads it), and those the block it runs sees."""
        assert run_function is not None, "Recompute with RNG is not support current device"
        seen_here = _modules()["recompute_hybrid"].paddle.device.get_all_custom_device_type()
        seen_by_block = run_function()
        calls.append(("recompute_forward", (ctx, run_function, all_outputs, mp_group, offload, partition,
                                            custom_get_state_func, custom_set_state_func, args, kwargs,
                                            seen_here, seen_by_block)))
        return "original recompute_forward"

    return forward


class _Topo:
    def __init__(self, lists):
        self.lists = lists

    def get_comm_list(self, name):
        return self.lists


def _on_a_gpu(mp):
    """The run is on a GPU as far as the plugin can ask (``paddle.get_device()``)."""
    mp.setattr(paddle, "get_device", lambda: "gpu:0")


def test_group_creation_on_nccl_reaches_paddle(fresh_plugin, monkeypatch):
    calls = _Calls()
    m = _modules()
    with _installed_over(monkeypatch, _recording_fakes(calls)):
        store = object()
        got = m["collective"]._new_process_group_impl("nccl", store, 0, 2, "g", None, 5)
        assert got == "original new_pg_impl"
        assert calls.of("new_pg_impl") == [("nccl", store, 0, 2, "g", None, 5)]  # the same store, not a private one


def test_no_pair_groups_when_the_pipeline_group_is_not_gloo(fresh_plugin, monkeypatch):
    calls = _Calls()
    hcg_cls = _modules()["topology"].HybridCommunicateGroup
    with _installed_over(monkeypatch, _recording_fakes(calls)) as mp:
        made = []
        mp.setattr(paddle.distributed, "new_group", lambda *a, **k: made.append((a, k)))
        hcg = hcg_cls.__new__(hcg_cls)
        hcg_cls.__init__(hcg, "topology", "configs")
        assert calls.of("hcg_init") == [(hcg, "topology", "configs")]
        assert made == []  # no group created on an NCCL job
        assert getattr(hcg, groups.PAIR_GROUPS_ATTR) == {}


@pytest.mark.parametrize("name", ["p2p_ops", "batched_p2p_ops"])
def test_p2p_on_a_nccl_pipeline_reaches_paddle(fresh_plugin, monkeypatch, name):
    calls = _Calls()
    p2p = _modules()["p2p"]
    with _installed_over(monkeypatch, _recording_fakes(calls)):
        hcg = _Hcg(_nccl_group())
        func = p2p._p2p_ops if name == "p2p_ops" else p2p._batched_p2p_ops
        assert func("send_prev", "recv_prev", "send_next", "recv_next", hcg) == f"original {name}"
        assert calls.of(name) == [("send_prev", "recv_prev", "send_next", "recv_next", hcg)]


def test_meta_messages_on_a_nccl_pipeline_reach_paddle(fresh_plugin, monkeypatch):
    calls = _Calls()
    p2p = _modules()["p2p"]
    with _installed_over(monkeypatch, _recording_fakes(calls)) as mp:
        group = _nccl_group()
        mp.setattr(p2p, "_hcg", _Hcg(group))
        meta = p2p.SendRecvMeta.__new__(p2p.SendRecvMeta)
        assert p2p.SendRecvMeta.send_meta(meta, "tensor", group) == "original send_meta"
        assert p2p.SendRecvMeta.recv_meta(meta, group, reverse=True) == "original recv_meta"
        # The pipeline group itself, not the pair group the gloo path would take.
        assert calls.of("send_meta") == [(meta, "tensor", group, False, False)]
        assert calls.of("recv_meta") == [(meta, group, True, False)]


def test_reduce_scatter_on_nccl_reaches_paddle(fresh_plugin, monkeypatch):
    calls = _Calls()
    rs = _modules()["reduce_scatter"]
    with _installed_over(monkeypatch, _recording_fakes(calls)):
        group = _nccl_group()
        assert rs._reduce_scatter_tensor_in_dygraph("out", "in", "sum", group, True, False) == "original rs_tensor"
        assert rs._reduce_scatter_in_dygraph("out", ["a", "b"], "sum", group, True, False) == "original rs_list"
        assert calls.of("rs_tensor") == [("out", "in", "sum", group, True, False, "reduce_scatter")]
        assert calls.of("rs_list") == [("out", ["a", "b"], "sum", group, True, False)]


def test_recompute_forward_on_a_gpu_reaches_paddle_unchanged(fresh_plugin, monkeypatch):
    calls = _Calls()
    fn_cls = _modules()["recompute_hybrid"]._HPRecomputeFunction
    with _installed_over(monkeypatch, _recording_fakes(calls)) as mp:
        _on_a_gpu(mp)
        mp.setattr(paddle.device, "get_all_custom_device_type", lambda: None)

        def block():
            return paddle.device.get_all_custom_device_type()

        outputs, group = [], _nccl_group()
        got = fn_cls.forward("ctx", block, outputs, group, True, True, "get", "set", "x", key="v")
        assert got == "original recompute_forward"
        ((ctx, run, outs, mp_group, offload, partition, get, set_, args, kwargs, seen_here, seen_by_block),) = \
            calls.of("recompute_forward")
        assert (ctx, run, outs, mp_group, get, set_, args, kwargs) == ("ctx", block, outputs, group, "get", "set",
                                                                       ("x",), {"key": "v"})
        assert offload is True and partition is True  # the caller's offload, not the CPU's False
        assert seen_here is None and seen_by_block is None  # Paddle's own answer to its gate


def test_recompute_forward_on_cpu_is_paddles_with_the_cpu_passing_its_gate(fresh_plugin, monkeypatch):
    """The narrow change: on a CPU run Paddle's forward itself runs; only its module (the
    ``paddle`` it reads) sees the CPU among the custom device types; offload is passed on as False."""
    calls = _Calls()
    fn_cls = _modules()["recompute_hybrid"]._HPRecomputeFunction
    with _installed_over(monkeypatch, _recording_fakes(calls)) as mp:
        mp.setattr(paddle.device, "get_all_custom_device_type", lambda: ["npu"])

        def block():
            return paddle.device.get_all_custom_device_type()

        assert fn_cls.forward("ctx", block, [], _gloo_group(), True, False, "get", "set", "x") \
            == "original recompute_forward"
        ((_, run, _, _, offload, _, _, _, args, _, seen_here, seen_by_block),) = calls.of("recompute_forward")
        assert run is block and args == ("x",)
        assert offload is False
        assert seen_here == ["npu", "cpu"]
        assert seen_by_block == ["npu"]  # the recomputed block and everything else: Paddle's answer
        assert paddle.device.get_all_custom_device_type() == ["npu"]


def test_recompute_activation_helpers_off_cpu_or_gloo_reach_paddle(fresh_plugin, monkeypatch):
    calls = _Calls()
    hybrid = _modules()["recompute_hybrid"]
    with _installed_over(monkeypatch, _recording_fakes(calls)):
        device_tensor, host_tensor = _DeviceTensor(), paddle.ones([4, 2])
        gloo, nccl = _gloo_group(), _nccl_group()
        assert hybrid._split_activation(device_tensor, gloo) == "original split_activation"
        # Gathered on NCCL: a host tensor (an offloaded activation) too goes to Paddle.
        assert hybrid._merge_activation(host_tensor, nccl) == "original merge_activation"
        assert hybrid._merge_activation(device_tensor, gloo) == "original merge_activation"
        assert calls.of("split_activation") == [(device_tensor, gloo)]
        assert calls.of("merge_activation") == [(host_tensor, nccl), (device_tensor, gloo)]


def test_recompute_split_on_cpu_leaves_the_callers_tensor(fresh_plugin):
    """partition=True over 2 ranks: this rank's half, the caller's activation untouched (Paddle's
    split flattens it in place)."""
    hybrid = _modules()["recompute_hybrid"]
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    h = paddle.arange(8, dtype="float32").reshape([2, 4])
    version = h.inplace_version
    part = hybrid._split_activation(h.detach(), _Group(ProcessGroupGloo(), nranks=2, rank=1))
    np.testing.assert_array_equal(part.numpy(), [4, 5, 6, 7])
    assert list(h.shape) == [2, 4] and h.inplace_version == version


def test_timers_on_a_gpu_reach_paddle(fresh_plugin, monkeypatch):
    calls = _Calls()
    helper = _modules()["timer_helper"]
    with _installed_over(monkeypatch, _recording_fakes(calls)) as mp:
        _on_a_gpu(mp)
        timer = helper._Timer("t")
        assert timer.start() == "original timer_start"
        assert timer.stop() == "original timer_stop"
        assert calls.of("timer_start") == [(timer,)] and calls.of("timer_stop") == [(timer,)]


class _TwoStageSchedule:
    """What the virtual pipeline check reads of a ``PipelineParallelWithInterleave``."""

    num_stages = 2
    accumulate_steps = 8

    def __init__(self, pipe_group):
        self._hcg = _Hcg(pipe_group)
        self.pp_group = pipe_group


@pytest.mark.parametrize("cls_name,fake", [("PipelineParallelWithInterleave", "interleave_check"),
                                           ("PipelineParallelWithInterleaveFthenB", "fthenb_check")])
def test_two_stage_virtual_pipeline_on_nccl_keeps_paddles_check(fresh_plugin, monkeypatch, cls_name, fake):
    calls = _Calls()
    cls = getattr(_modules()["pipeline_parallel"], cls_name)
    with _installed_over(monkeypatch, _recording_fakes(calls)):
        schedule = _TwoStageSchedule(_nccl_group())
        assert cls._check_sanity(schedule) == f"original {fake}"
        assert calls.of(fake) == [(schedule,)]
        # On gloo the same two stages are lifted (Paddle's check not called).
        assert cls._check_sanity(_TwoStageSchedule(_gloo_group())) is None
        assert len(calls.of(fake)) == 1


def test_device_id_on_a_gpu_reaches_paddle(fresh_plugin, monkeypatch):
    calls = _Calls()
    parallel = _modules()["parallel"]
    with _installed_over(monkeypatch, _recording_fakes(calls)) as mp:
        env = parallel.ParallelEnv()
        assert "_device_id" not in vars(env)  # a CPU build sets none
        _on_a_gpu(mp)
        assert env.device_id == "original device_id"
        assert calls.of("device_id") == [(env,)]


def test_device_id_is_a_default_only_on_cpu(fresh_plugin, monkeypatch):
    """Off the CPU an environment without a device id keeps Paddle's error (no silent 0)."""
    parallel = _modules()["parallel"]
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    env = parallel.ParallelEnv()
    assert env.device_id == 0
    with monkeypatch.context() as mp:
        _on_a_gpu(mp)
        with pytest.raises(AttributeError, match="_device_id"):
            env.device_id  # noqa: B018  (the read is the test)


# ---------------------------------------------------------------------------
# virtual_pipeline fails closed when Paddle's source cannot be read
# ---------------------------------------------------------------------------

def _check_without_source(name):
    """A ``_check_sanity`` compiled from a string: it holds Paddle's assertion, but
    ``inspect.getsource`` cannot read it (as with a Paddle shipped without ``.py`` files)."""
    namespace = {}
    exec(compile(f"def {name}(self):\n    assert self.num_stages > 2, {_VP_CHECK!r}\n", "<no source>", "exec"),
         namespace)
    return namespace[name]


def test_vp_lift_refused_when_the_source_cannot_be_read(fresh_plugin, monkeypatch):
    pp = _modules()["pipeline_parallel"]
    fakes = [(pp.PipelineParallelWithInterleave, "_check_sanity", _check_without_source("interleave")),
             (pp.PipelineParallelWithInterleaveFthenB, "_check_sanity", _check_without_source("fthenb"))]
    with monkeypatch.context() as mp:
        for owner, name, fake in fakes:
            mp.setattr(owner, name, fake)
        try:
            with pytest.warns(RuntimeWarning, match=r"cannot read the source of PipelineParallelWithInterleave"
                                                    r"\._check_sanity .*two stages stays refused by Paddle"):
                state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
            assert state.status == "active"  # the rest of the CPU support is installed
            for owner, name, fake in fakes:
                assert vars(owner)[name] is fake, owner  # Paddle's check left in place
            with pytest.raises(AssertionError, match="pp degree > 2"):
                pp.PipelineParallelWithInterleave._check_sanity(_TwoStageSchedule(_gloo_group()))
        finally:
            paddle_hybrid.uninstall_component("cpu")
