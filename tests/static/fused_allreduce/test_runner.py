"""StaticRunner in one process: what it refuses (the 2-rank runs are in test_train_2proc.py)."""
import paddle
import paddle.distributed as dist
import pytest
from paddle.pir_utils import OldIrGuard
from paddle.utils import unique_name

import models
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


class _LonelyStore:
    """The job's store as rank 0 sees it when rank 1 never publishes."""

    def __init__(self):
        self.values, self.counters = {}, {}

    def set(self, key, value):
        self.values[key] = value.encode()

    def get(self, key):
        return self.values[key]

    def add(self, key, amount):
        self.counters[key] = self.counters.get(key, 0) + amount
        return self.counters[key]


class _EchoStore(_LonelyStore):
    """Rank 1 publishes whatever rank 0 publishes: the ranks agree."""

    def set(self, key, value):
        super().set(key, value)
        exchange_key = key[: key.rindex("/")]
        super().set(exchange_key + "/1", value)
        super().add(exchange_key + "/present/0", 1 << 1)  # rank 1's bit of the presence counter


def test_a_layout_check_that_runs_out_of_time_names_the_missing_rank_and_leaves_the_runner_usable(monkeypatch):
    """Rank 1 never publishes its layout: construction raises after the timeout naming rank 1 and
    the deadline's setting, in static mode as before; nothing is left blocked, so the next check,
    with rank 1 there, passes (before, the collective left behind made the group unusable)."""
    from paddle_hybrid.common import exchange

    main, startup = _program()
    monkeypatch.setattr(dist, "get_world_size", lambda *args, **kwargs: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(runner, "ensure_process_group", lambda: None)
    monkeypatch.setattr(exchange, "job_store", _LonelyStore)
    paddle.enable_static()
    with pytest.raises(TimeoutError, match=r"waited 0.3 s for rank 1.*check_timeout \(StaticRunner\)"):
        StaticRunner(main, startup, check_timeout=0.3)
    assert not paddle.in_dynamic_mode()
    monkeypatch.setattr(exchange, "job_store", _EchoStore)
    assert StaticRunner(main, startup, check_timeout=0.3).fingerprint == layout_fingerprint(main._ph_fused_allreduce)
