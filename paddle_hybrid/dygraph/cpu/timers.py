"""Fleet's timers on CPU: ``pp_configs.enable_timer`` (and ``enable_optimizer_timer``).

1. ``fleet.utils.timer_helper._Timer.start`` / ``.stop``: every start and stop first
   waits for the GPU with ``paddle.device.cuda.synchronize()``, which on a CPU build
   raises ``RuntimeError: (Unavailable) Paddle is not compiled with CUDA. Cannot visit
   device synchronize.``, so ``PipelineParallel.train_batch`` with
   ``strategy.hybrid_configs["pp_configs"].enable_timer = True`` stops at its first
   ``forward_step``.  Patch: on a CPU place there is no asynchronous device work to
   wait for (an op has finished when its call returns, a gloo collective too), so the
   timer reads the clock directly; ``time.perf_counter`` (monotonic, sub-microsecond)
   rather than ``time.time``, since a tiny stage's forward takes well under a
   millisecond.  Asked at every start and stop (``paddle_hybrid.registry.device.running_on_cpu``:
   the device stock Paddle would synchronize is the current one); a run on another device
   gets the stock methods, with their device sync.

The timers keep their stock fields (``elapsed_``, ``started_``, ``start_time``), so
``Timers.log`` / ``elapsed()`` and ``PipelineParallel.timer_printer`` work unchanged.
"""
from __future__ import annotations

import functools
import time

from ...registry.device import running_on_cpu

__all__ = ["apply"]


def _make_start(stock_start):
    @functools.wraps(stock_start)
    def start(self):
        if not running_on_cpu():
            return stock_start(self)
        if self.started_:
            raise AssertionError(f"timer {self.name!r} has already started")
        self.start_time = time.perf_counter()
        self.started_ = True

    return start


def _make_stop(stock_stop):
    @functools.wraps(stock_stop)
    def stop(self):
        if not running_on_cpu():
            return stock_stop(self)
        if not self.started_:
            raise AssertionError(f"timer {self.name!r} is not started")
        self.elapsed_ += time.perf_counter() - self.start_time
        self.started_ = False

    return stop


def apply(config, patcher) -> None:
    import importlib

    helper = importlib.import_module("paddle.distributed.fleet.utils.timer_helper")
    timer_cls = patcher.require(helper, "_Timer", "fleet.utils.timer_helper")
    stock_start = patcher.require(timer_cls, "start", "timer_helper._Timer")
    stock_stop = patcher.require(timer_cls, "stop", "timer_helper._Timer")
    patcher.check_params(stock_start, ["self"], "timer_helper._Timer.start")
    patcher.check_params(stock_stop, ["self"], "timer_helper._Timer.stop")
    # Our methods keep the timer's state in the stock fields; make sure they exist.
    probe = timer_cls("paddle_hybrid_probe")
    for field in ("elapsed_", "started_", "start_time", "name"):
        patcher.require(probe, field, "timer_helper._Timer()")

    patcher.set(timer_cls, "start", _make_start(stock_start))
    patcher.set(timer_cls, "stop", _make_stop(stock_stop))
