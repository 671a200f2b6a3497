"""StaticRunner in one process: what it refuses (the 2-rank runs are in test_train_2proc.py)."""
import threading

import paddle
import paddle.distributed as dist
import pytest
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

import models
from paddle_hybrid.common import layout_check
from paddle_hybrid.static.fused_allreduce import (FuseAllreduceConfig, StaticRunner, apply_fuse_allreduce,
                                           layout_fingerprint, runner)


def _program(rewrite=True):
    paddle.enable_static()
    with OldIrGuard(), unique_name.guard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            _, _, loss = models.build("mlp", 4)
            _, pg = paddle.optimizer.SGD(0.1).minimize(loss)
        if rewrite:
            apply_fuse_allreduce(main, pg, FuseAllreduceConfig(nranks=2))
    return main, startup


def test_runner_rejects_program_without_rewrite():
    main, startup = _program(rewrite=False)
    with pytest.raises(ValueError, match="not rewritten"):
        StaticRunner(main, startup)


def test_runner_takes_the_check_timeout_from_the_plugin_config():
    main, startup = _program()
    runner_ = StaticRunner(main, startup)  # one rank: the check returns the fingerprint at once
    assert runner_.fingerprint == layout_fingerprint(main._ph_fused_allreduce)


def test_runner_refuses_the_group_after_a_layout_check_timeout(monkeypatch):
    """The layout check's all_gather never returns (a rank that never joins): construction
    raises TimeoutError after the timeout, and from then on the default group is unusable: a
    runner built before refuses to run, a new one refuses to be built (the old runner raised
    TimeoutError again and would have run on the group)."""
    monkeypatch.setattr(layout_check, "_unusable", {})  # restored after the test
    main, startup = _program()
    earlier = StaticRunner(main, startup, check_timeout=1.0)  # one rank: nothing to check
    release = threading.Event()
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    monkeypatch.setattr(runner, "ensure_process_group", lambda: None)
    monkeypatch.setattr(dist, "all_gather_object", lambda *args, **kwargs: release.wait(60))
    try:
        with pytest.raises(TimeoutError, match="within 0 s"):
            StaticRunner(main, startup, check_timeout=0.3)
        with pytest.raises(layout_check.GroupUnusableError, match="default"):
            StaticRunner(main, startup, check_timeout=0.3)
        with pytest.raises(layout_check.GroupUnusableError):
            earlier.run(feed={}, fetch_list=[])
        with pytest.raises(layout_check.GroupUnusableError):
            earlier.run_startup()
    finally:
        release.set()  # let the blocked thread finish


def test_a_timed_out_layout_check_leaves_the_static_mode_state_alone(monkeypatch):
    """The gather thread blocks for good (a rank that never joins).  After the TimeoutError the
    caller is still in static mode with its own default programs and unique-name generator:
    the dygraph guard the gather needs was entered and left by the caller, not by the thread
    (which, blocked inside it, would leave them swapped for the rest of the process)."""
    from paddle.base import framework
    from paddle.base import unique_name as names

    monkeypatch.setattr(layout_check, "_unusable", {})
    release = threading.Event()
    seen_dynamic = []

    def blocked_gather(*args, **kwargs):
        seen_dynamic.append(paddle.in_dynamic_mode())
        release.wait(60)

    monkeypatch.setattr(dist, "all_gather_object", blocked_gather)
    paddle.enable_static()
    main, startup = paddle.static.default_main_program(), paddle.static.default_startup_program()
    generator = names.generator
    try:
        with pytest.raises(TimeoutError, match="within 0 s"):
            layout_check.gather_and_compare([1], timeout=0.3, what="probe layout", fix="none")
        assert not paddle.in_dynamic_mode()
        assert paddle.static.default_main_program() is main
        assert paddle.static.default_startup_program() is startup
        assert names.generator is generator
        assert framework._dygraph_tracer() is None
        assert seen_dynamic == [True]  # the gather itself ran in dygraph
    finally:
        release.set()
