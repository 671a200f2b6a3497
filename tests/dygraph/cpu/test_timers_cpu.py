"""Fleet's pipeline timers on CPU (paddle_hybrid.dygraph.cpu.timers).

Stock Paddle 3.3.1: every ``_Timer.start``/``stop`` calls
``paddle.device.cuda.synchronize()``, so ``train_batch`` with
``pp_configs.enable_timer=True`` stops with "Paddle is not compiled with CUDA. Cannot
visit device synchronize."  With the plugin the timers read the wall clock on CPU.

On 2 gloo ranks (``worker_recompute.py``, one launch): PP=2 with ``enable_timer``, 4
microbatches, 2 steps, without and with ``recompute_interval=1``; every block's forward
sleeps 5 ms, so per step a stage's ``forward_step`` is at least 4 x 2 x 5 ms and, with
recompute, its ``backward_step`` at least (recomputed blocks) x 4 x 5 ms.  The timer
lines ``train_batch`` prints are captured on every rank.
"""
import os
import re
import time

import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph import cpu
from paddle_hybrid.testing import launch

from paddle.distributed.fleet.utils import timer_helper

HERE = os.path.dirname(os.path.abspath(__file__))


def test_timer_measures_wall_time():
    t = timer_helper._Timer("ph_test")
    t.start()
    time.sleep(0.02)
    t.stop()
    t.start()
    time.sleep(0.01)
    elapsed = t.elapsed()  # stops and restarts a running timer
    assert 0.03 <= elapsed < 1.0, elapsed
    t.stop()
    with pytest.raises(AssertionError, match="is not started"):
        t.stop()
    t.start()
    with pytest.raises(AssertionError, match="has already started"):
        t.start()


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="the stock failure is CPU-only")
def test_stock_timer_fails_on_cpu(fresh_plugin):
    with pytest.raises(RuntimeError, match="not compiled with CUDA"):
        timer_helper._Timer("ph_stock").start()


def test_uninstall_restores_timer_patches(fresh_plugin):
    def current():
        return {n: timer_helper._Timer.__dict__[n] for n in ("start", "stop")}

    stock = current()
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    patched = current()
    for k in stock:
        assert patched[k] is not stock[k], k
        assert (timer_helper._Timer, k) in cpu.patched()
    paddle_hybrid.uninstall_component("cpu")
    assert current() == stock


def _parse(line):
    assert line.startswith("time (ms)"), line
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"\| (\w+): ([0-9.]+)", line)}


def test_pp2_enable_timer_reports_real_times():
    sleep_ms, micro, blocks_per_stage = 5, 4, 2
    specs = [f"rc=0,timer=1,sleep={sleep_ms}", f"rc=1,timer=1,sleep={sleep_ms}"]
    results = launch(os.path.join(HERE, "worker_recompute.py"), nprocs=2, timeout=240,
                     args=["--variants", ";".join(specs), "--steps", "2", "--acc", str(micro),
                           "--reference", "0", "--partition", "0"])
    for r in results:
        # stage 0 does not recompute its first block: its input needs no gradient
        recomputed = blocks_per_stage - (1 if r["stage"] == 0 else 0)
        for spec in specs:
            lines = r["variants"][spec]["timer_log"]
            assert len(lines) == 2, (r["rank"], spec, lines)  # one per train_batch
            for line in lines:
                t = _parse(line)
                assert t["forward_step"] >= 0.99 * micro * blocks_per_stage * sleep_ms, (r["rank"], spec, line)
                assert t["backward_step"] > 0, (r["rank"], spec, line)
                if spec.startswith("rc=1"):  # the backward reruns the forward (and its sleeps)
                    assert t["backward_step"] >= 0.99 * micro * recomputed * sleep_ms, (r["rank"], spec, line)
                assert all(v >= 0 for v in t.values())
