"""StaticRunner in one process: what it refuses (the 2-rank runs are in test_train_2proc.py)."""
import threading

import paddle
import paddle.distributed as dist
import pytest
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

import models
from paddle_hybrid import layout_check
from paddle_hybrid.fused_allreduce import (FuseAllreduceConfig, StaticRunner, apply_fuse_allreduce,
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
