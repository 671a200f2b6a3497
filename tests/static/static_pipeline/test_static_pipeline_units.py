"""The static pipeline runner's parts, in one process: the schedule, the split by op role, the
lowering for gloo, the rings' timeouts, the component's switch and device rule."""
import inspect
import threading
import time

import paddle
import pytest

import paddle_hybrid
from paddle_hybrid import ops
from paddle_hybrid.catalog import install as _install
from paddle_hybrid.config import PluginConfig
from paddle_hybrid.static.send_wait import apply_pipeline_send_wait
from paddle_hybrid.gloo import rings
from paddle_hybrid.static.static_pipeline import lowering, runner
from paddle_hybrid.registry.gate import decide
from paddle_hybrid.static.static_pipeline.schedule import BACKWARD, FORWARD, LR, OPTIMIZER, job_order
from paddle_hybrid.testing.static_programs import build_pipeline_program

F, B = FORWARD, BACKWARD


# -- schedule -----------------------------------------------------------------------------

def test_f_then_b_order():
    assert job_order("F-then-B", 0, 2, 3) == [(LR, 0), (F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2), (OPTIMIZER, 0)]


def test_1f1b_order_per_stage():
    assert job_order("1F1B", 0, 2, 4)[1:-1] == [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (F, 3), (B, 2), (B, 3)]
    assert job_order("1F1B", 1, 2, 4)[1:-1] == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]
    # warm-up never exceeds the micro-batches
    assert job_order("1F1B", 0, 3, 1)[1:-1] == [(F, 0), (B, 0)]


@pytest.mark.parametrize("schedule", ["1F1B", "F-then-B"])
@pytest.mark.parametrize("stage,stages,n", [(0, 3, 4), (1, 3, 4), (2, 3, 4), (0, 4, 2)])
def test_every_microbatch_forward_before_backward(schedule, stage, stages, n):
    order = job_order(schedule, stage, stages, n)
    assert order[0] == (LR, 0) and order[-1] == (OPTIMIZER, 0)
    body = order[1:-1]
    assert sorted(body) == sorted([(F, i) for i in range(n)] + [(B, i) for i in range(n)])
    for i in range(n):
        assert body.index((F, i)) < body.index((B, i))
    in_flight = max(sum(1 for j, (t, _) in enumerate(body[:k + 1]) if t == F) -
                    sum(1 for t, _ in body[:k + 1] if t == B) for k in range(len(body)))
    if schedule == "1F1B":
        assert in_flight <= stages - stage


def test_schedule_rejects_unknown_mode():
    with pytest.raises(ValueError, match="schedule_mode"):
        job_order("interleaved", 0, 2, 4)


# -- split by op role ---------------------------------------------------------------------

def _section(schedule="F-then-B", stage=0, stages=2):
    with paddle.pir_utils.OldIrGuard():
        return build_pipeline_program(stage, stages=stages, schedule=schedule, microbatches=4)


def test_split_by_phase_partitions_the_ops():
    paddle.enable_static()
    section = _section()
    with paddle.pir_utils.OldIrGuard():
        subs = runner.split_by_phase(section)
    types = {t: [op.type for op in p.global_block().ops] for t, p in subs.items()}
    assert sum(len(v) for v in types.values()) == len(section.global_block().ops)
    assert types[LR] == ["fill_constant", "fill_constant"]  # the @MERGED accumulators, once per step
    assert types[OPTIMIZER] == ["sgd", "sgd"]
    assert "send_v2" in types[FORWARD] and "recv_v2" in types[BACKWARD]
    for job_type, program in subs.items():
        assert all(runner.phase_of(op) == job_type for op in program.global_block().ops)
        assert set(program.global_block().vars) == set(section.global_block().vars)


# -- lowering -----------------------------------------------------------------------------

@pytest.fixture
def fake_rings(monkeypatch):
    known = {}
    for ring_id in (20, 21):
        known[ring_id] = rings.RingInfo(ring_id, 0, ["127.0.0.1:1", "127.0.0.1:2"])
    monkeypatch.setattr(rings, "rings", known)
    return known


@pytest.mark.parametrize("schedule", ["1F1B", "F-then-B"])
def test_lowering_replaces_p2p_and_syncs_only(fake_rings, schedule):
    paddle.enable_static()
    section = _section(schedule)
    with paddle.pir_utils.OldIrGuard():
        apply_pipeline_send_wait(section)
        before = [op.type for op in section.global_block().ops]
        lowered = lowering.lower_for_gloo(section, 600.0)
    after = [op.type for op in lowered.global_block().ops]
    assert [op.type for op in section.global_block().ops] == before  # the checked program is untouched
    assert not {"send_v2", "recv_v2", "c_sync_calc_stream", "c_sync_comm_stream"} & set(after)
    assert after.count("py_func") == before.count("send_v2") + before.count("recv_v2") + before.count("c_sync_comm_stream")
    assert after.count(ops.NOP_OP) == before.count(ops.NOP_OP) == 1  # the keep-alive stays
    kept = [t for t in before if t not in ("send_v2", "recv_v2", "c_sync_calc_stream", "c_sync_comm_stream")]
    assert [t for t in after if t != "py_func"] == kept


def test_lowering_without_ring_names_the_fix(monkeypatch):
    paddle.enable_static()
    monkeypatch.setattr(rings, "rings", {})
    section = _section()
    with paddle.pir_utils.OldIrGuard(), pytest.raises(RuntimeError, match="Import paddle_hybrid before building"):
        lowering.lower_for_gloo(section, 600.0)


# -- timeouts -----------------------------------------------------------------------------

def test_ring_rendezvous_times_out_naming_ring_and_ranks(monkeypatch):
    """Ring rank 0 of 2 waits at the rendezvous for a rank 1 that never comes: the wait ends at the
    ring's deadline, not the job store's, with the ring, its ranks and the setting named."""
    import socket

    from paddle.base import core

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job_store = core.TCPStore("127.0.0.1", port, True, 1, 30)
    monkeypatch.setattr(rings, "_global_store", lambda: job_store)
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    info = rings.RingInfo(21, 0, ["127.0.0.1:6170", "127.0.0.1:6171"])
    start = time.monotonic()
    with pytest.raises(rings.RingTimeoutError) as caught:
        rings.create_ring(info, "unit", 0.5)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert "ring 21 (ranks at 127.0.0.1:6170, 127.0.0.1:6171" in message, message
    assert "was not set within 0.5 s" in message and rings.DEADLINE_SETTING in message, message
    assert "ring rank 1 (127.0.0.1:6171) did not reach the rendezvous" in message, message
    assert 21 not in rings.rings


class _StuckGroup:
    def __init__(self):
        self.release = threading.Event()

    def send(self, tensor, peer, sync_op):
        group = self

        class _Task:
            def wait(self):
                group.release.wait(10)

        return _Task()


def test_send_drain_times_out_naming_the_ring(monkeypatch):
    info = rings.RingInfo(77, 0, ["127.0.0.1:1", "127.0.0.1:2"])
    info.group = _StuckGroup()
    monkeypatch.setattr(rings, "rings", {77: info})
    monkeypatch.setitem(lowering._senders, 77, lowering._Sender(77))
    import numpy as np

    lowering._senders[77].submit(np.zeros(2, "float32"), 1)
    with pytest.raises(rings.RingTimeoutError, match="ring 77 .*1 send"):
        lowering._senders[77].drain(0.2)
    info.group.release.set()
    lowering._senders[77].drain(5)  # once received, the queue drains


# -- switch and device rule ---------------------------------------------------------------

def test_config_field_and_env(monkeypatch):
    assert PluginConfig().static_pipeline == "auto"
    monkeypatch.setenv("PADDLE_HYBRID_STATIC_PIPELINE", "Off")
    monkeypatch.setenv("PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT", "7.5")
    config = PluginConfig.from_env()
    assert (config.static_pipeline, config.static_pipeline_timeout) == ("off", 7.5)
    with pytest.raises(ValueError, match="PADDLE_HYBRID_STATIC_PIPELINE"):
        PluginConfig(static_pipeline="yes")
    with pytest.raises(ValueError, match="PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT"):
        PluginConfig(static_pipeline_timeout=0)


def test_device_rule():
    """The one gate decides static_pipeline; allow_unrun reaches it (it did not before the gate
    was one function)."""
    assert decide(PluginConfig(static_pipeline="off"), "static_pipeline").reason == "switched off (static_pipeline='off')"
    assert decide(PluginConfig(), "static_pipeline").on  # this build has no accelerator
    on_cuda = decide(PluginConfig(), "static_pipeline", accelerator="cuda")
    assert not on_cuda.on
    assert "never run on cuda" in on_cuda.reason and "PADDLE_HYBRID_STATIC_PIPELINE=on" in on_cuda.reason
    assert decide(PluginConfig(static_pipeline="on"), "static_pipeline", accelerator="cuda").on
    assert decide(PluginConfig(allow_unrun=True), "static_pipeline", accelerator="cuda").on
    assert not decide(PluginConfig(allow_unrun=True, static_pipeline="off"), "static_pipeline", accelerator="cuda").on


def test_uninstall_restores_paddle():
    from paddle.base import executor
    from paddle.distributed.fleet.meta_optimizers import common
    from paddle.distributed.fleet.meta_optimizers import pipeline_optimizer as fleet_pipeline
    from paddle.incubate.optimizer import pipeline

    def current():
        return (executor.Executor.run, pipeline.PipelineOptimizer.minimize,
                common.CollectiveHelper._init_communicator, fleet_pipeline.PipelineOptimizer._init_process_group)

    assert "static_pipeline" in _install.installed_components()
    patched = current()
    _install.uninstall_component("static_pipeline")
    try:
        originals = current()
        assert all(a is not b and inspect.unwrap(a) is b for a, b in zip(patched, originals))
    finally:
        _install.install_component("static_pipeline")
    # the registry installs each wrapper behind a link: Paddle's method is at the chain's end
    assert all(inspect.unwrap(f) is o for f, o in zip(current(), originals))


def test_plain_programs_run_as_before():
    """Only fleet pipeline programs take the runner; a plain static program runs unchanged."""
    import numpy as np

    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [2, 3], "float32")
            y = x * 2.0
        assert not runner.is_pipeline_main(main) and not runner.is_pipeline_startup(startup)
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(startup)
        out, = exe.run(main, feed={"x": np.ones([2, 3], "float32")}, fetch_list=[y])
    np.testing.assert_array_equal(out, np.full([2, 3], 2.0, "float32"))
    assert paddle_hybrid  # installed by conftest


@pytest.mark.parametrize("value", ["0.5", "inf", "nan", "1e30", "-3"])
@pytest.mark.parametrize("env", ["PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT", "PADDLE_HYBRID_STATIC_LAYOUT_CHECK_TIMEOUT"])
def test_timeout_outside_the_range_is_refused(monkeypatch, env, value):
    """0.5 s became int 0 (no deadline) and inf overflowed; both were accepted before."""
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=rf"in \[1, 86400\].*{env}"):
        PluginConfig.from_env()
