"""The device rule: on a build with an accelerator, every path that has never run there is off
until opted in (per feature or all at once), report() says so, and opting in turns each on.

Builds are faked by monkeypatching what :mod:`paddle_hybrid.registry.device` asks Paddle."""
import dataclasses

import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.catalog import install as _install
from paddle_hybrid.registry.device import accelerator_build
from paddle_hybrid.config import ENVIRONMENT
from paddle_hybrid.registry.gate import GATED, decide

UNRUN_PATHS = {field: path for field, path in GATED.items() if path.kind == "unrun"}
AUTO_ON_OFF = {field: path for field, path in GATED.items() if path.kind == "auto_on_off"}

FAKE_BUILDS = {
    "cuda": dict(cuda=True, xpu=False, custom=[]),
    "xpu": dict(cuda=False, xpu=True, custom=[]),
    "custom:npu": dict(cuda=False, xpu=False, custom=["npu"]),
}


def fake_build(monkeypatch, cuda=False, xpu=False, custom=()):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: cuda)
    monkeypatch.setattr(paddle, "is_compiled_with_xpu", lambda: xpu)
    monkeypatch.setattr(paddle.device, "get_all_custom_device_type", lambda: list(custom))


@pytest.mark.parametrize("name", sorted(FAKE_BUILDS))
def test_accelerator_build_names_the_fake(monkeypatch, name):
    fake_build(monkeypatch, **FAKE_BUILDS[name])
    assert accelerator_build() == name


def test_cpu_build_runs_every_path_by_default():
    assert accelerator_build() is None  # this machine
    for field in UNRUN_PATHS:
        assert decide(PluginConfig(), field).on
        assert not decide(PluginConfig(**{field: False}), field).on


@pytest.mark.parametrize("name", sorted(FAKE_BUILDS))
def test_accelerator_build_needs_an_opt_in(name):
    for field, path in UNRUN_PATHS.items():
        default = decide(PluginConfig(), field, accelerator=name)
        assert not default.on
        assert f"written, never run on {name}" in default.reason and f"{ENVIRONMENT[field]}=1" in default.reason
        assert decide(PluginConfig(**{field: True}), field, accelerator=name).on
        assert decide(PluginConfig(allow_unrun=True), field, accelerator=name).on
        # an explicit off wins over the blanket opt-in
        assert not decide(PluginConfig(allow_unrun=True, **{field: False}), field, accelerator=name).on


def test_environment_tri_state(monkeypatch):
    for field, path in UNRUN_PATHS.items():
        monkeypatch.delenv(ENVIRONMENT[field], raising=False)
        assert getattr(PluginConfig.from_env(), field) is None
        monkeypatch.setenv(ENVIRONMENT[field], "1")
        assert getattr(PluginConfig.from_env(), field) is True
        monkeypatch.setenv(ENVIRONMENT[field], "0")
        assert getattr(PluginConfig.from_env(), field) is False
        monkeypatch.delenv(ENVIRONMENT[field])
    monkeypatch.setenv("PADDLE_HYBRID_ALLOW_UNRUN", "1")
    assert PluginConfig.from_env().allow_unrun is True
    with pytest.raises(TypeError, match="grad_buckets must be None"):
        PluginConfig(grad_buckets="yes")


def _component_status(name):
    return _install.component_state(name).status


def test_faked_cuda_build_installs_only_what_ran_there(monkeypatch, plugin_restored):
    """On a faked CUDA build with the default config: the gradient buckets and the pipeline CUDA
    graphs stay off and report() says how to opt in; the device-independent components stay on;
    with the per-feature opt-in, and with allow_unrun, each turns on."""
    paddle_hybrid.uninstall()
    fake_build(monkeypatch, cuda=True)
    paddle_hybrid.install(PluginConfig())
    assert _component_status("grad_buckets") == "off"
    assert _component_status("cuda_graph") == "off"
    for name in ("reshard", "fleet_fixes"):
        assert _component_status(name) == "active", name
    for name in ("fused_allreduce", "send_wait"):  # tri-state: written, never run on cuda
        assert _component_status(name) == "off", name
    text = paddle_hybrid.report()
    assert "(cuda build)" in text
    for field, path in UNRUN_PATHS.items():
        line = next(line for line in text.splitlines() if line.strip().startswith(field + " "))
        assert " off: written, never run on cuda" in line and f"{ENVIRONMENT[field]}=1" in line, line

    for opt_in in (dict(grad_buckets=True, cuda_graph=True), dict(allow_unrun=True)):
        paddle_hybrid.uninstall()
        paddle_hybrid.install(PluginConfig(cpu="off", **opt_in))
        assert _component_status("grad_buckets") == "active", opt_in
        assert _component_status("cuda_graph") == "active", opt_in
        assert "opted in" in paddle_hybrid.report()


def test_allow_unrun_reaches_every_gated_path(monkeypatch, plugin_restored):
    """One gate for every auto/on/off and tri-state field: on a faked CUDA build the CPU/gloo
    components (auto) are off and report() lists each with its opt-in; PADDLE_HYBRID_ALLOW_UNRUN
    turns every one of them on (before, it reached only the four tri-state paths), and an
    explicit off still wins."""
    names = {"cpu": "cpu", "expert_parallel": "expert_parallel", "static_pipeline": "static_pipeline",
             "auto_parallel_cpu": "auto_parallel_cpu", "sharding_fused_comm": "sharding_fused_comm"}
    assert set(AUTO_ON_OFF) == set(names)
    paddle_hybrid.uninstall()
    fake_build(monkeypatch, cuda=True)
    paddle_hybrid.install(PluginConfig())
    text = paddle_hybrid.report()
    for field, name in names.items():
        assert _component_status(name) == "off", name
        line = next(line for line in text.splitlines() if line.strip().startswith(field + " "))
        assert f"off: written, never run on cuda: opt in with {ENVIRONMENT[field]}=on" in line, line
    paddle_hybrid.uninstall()
    monkeypatch.setenv("PADDLE_HYBRID_ALLOW_UNRUN", "1")
    monkeypatch.setenv("PADDLE_HYBRID_EXPERT_PARALLEL", "off")
    paddle_hybrid.install()
    for field, name in names.items():
        expected = "off" if field == "expert_parallel" else "active"
        assert _component_status(name) == expected, name


def test_static_meta_optimizers_follow_the_rule(monkeypatch, plugin_restored):
    """The send-wait and fused all_reduce meta optimizers are their components' (``send_wait``,
    ``fused_allreduce``): on a faked CUDA build fleet does not know them without an opt-in; with one
    they apply by the strategy.  The fused class fleet gets carries the config; the bare class,
    given none, never applies."""
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory

    from paddle_hybrid.static.fused_allreduce.meta_optimizer import FusedAllreduceOptimizer

    class Strategy:  # what the rule lets through reaches the strategy checks
        pipeline = True
        sharding = False

    class RoleMaker:
        _is_collective = True

        def _worker_num(self):
            return 2

    def made(name):
        cls = getattr(factory, name)
        optimizer = cls.__new__(cls)
        optimizer.role_maker, optimizer.user_defined_strategy = RoleMaker(), Strategy()
        return optimizer

    names = ("PipelineSendWaitOptimizer", "FusedAllreduceOptimizer")
    paddle_hybrid.uninstall()
    fake_build(monkeypatch, cuda=True)
    paddle_hybrid.install(PluginConfig(cpu="off"))
    assert not any(n in factory.meta_optimizer_names or hasattr(factory, n) for n in names)
    paddle_hybrid.uninstall()
    paddle_hybrid.install(PluginConfig(cpu="off", send_wait=True, fused_allreduce=True))
    assert all(n in factory.meta_optimizer_names for n in names)
    assert made("PipelineSendWaitOptimizer")._can_apply() is True
    with pytest.raises(AttributeError):  # it reads the fake strategy (which lacks fields)
        made("FusedAllreduceOptimizer")._can_apply()
    bare = FusedAllreduceOptimizer.__new__(FusedAllreduceOptimizer)
    bare.role_maker, bare.user_defined_strategy = RoleMaker(), Strategy()
    assert bare._can_apply() is False  # no config: declined before the strategy is read


def test_graph_backend_and_clock_follow_where_the_run_is(monkeypatch):
    """A CUDA build running on CPU gets the emulation and the wall clock; a GPU run gets the CUDA
    backend only with the opt-in."""
    from paddle_hybrid.dygraph.cuda_graph import backends
    from paddle_hybrid.dygraph.timeline import recorder

    fake_build(monkeypatch, cuda=True)
    monkeypatch.setattr(backends, "cuda_graphs_available", lambda: True)
    assert backends.auto_backend_name(PluginConfig(cuda_graph=True)) == "emulation"  # run is on CPU
    assert isinstance(recorder.choose_clock(), recorder._WallClock)
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    monkeypatch.setattr(backends, "_warned_unrun", False)
    with pytest.warns(RuntimeWarning, match="never run on a GPU"):
        assert backends.auto_backend_name(PluginConfig()) == "emulation"
    assert backends.auto_backend_name(PluginConfig(cuda_graph=True)) == "cuda"
    assert backends.auto_backend_name(PluginConfig(allow_unrun=True)) == "cuda"
    monkeypatch.setattr(recorder, "_CudaEventClock", lambda: "cuda-event-clock")
    with pytest.warns(RuntimeWarning, match="never run on a GPU"):
        assert recorder.choose_clock() == "cuda-event-clock"
