"""The dry run's probe counts what is saved for backward through Paddle's saved-tensor hooks; the
hooks must not change what the run holds.

Seen failing first: with the probe's pack hook returning the saved tensor itself, every step's saved
activations stayed alive (an op's output saved for its own backward points back at its grad node,
which holds what the hook returned: a cycle in C++).  Here the allocated bytes after each step grew
by a step's activations (the test below failed at step 2); a tiny LLaMA's pipeline stage 0 through
PaddleFormers' Trainer grew 0.04 -> 0.07 -> 0.10 -> 0.14 -> 0.17 GiB, and LLaMA-3-8B's stage 0 at
tp8 x pp4 measured a step-2 peak of 18.9 GiB over the 10.4 it holds (benchmarks/bench_dryrun.py).
"""
import paddle
from paddle.base import core

from paddle_hybrid.dygraph import dryrun_probe

STEPS = 5


def _allocated():
    return core.host_memory_stat_current_value("Allocated", 0)


def _step(w):
    x = paddle.randn([64, 256])
    y = paddle.nn.functional.softmax(paddle.matmul(x, w), axis=-1)  # softmax saves its own output
    y = paddle.exp(y)  # exp too
    y.sum().backward()
    w.clear_gradient()


def _after_each_step(pack, unpack):
    paddle.seed(0)
    w = paddle.create_parameter([256, 256], "float32")
    core.eager.register_saved_tensors_hooks(pack, unpack)
    try:
        after = []
        for _ in range(STEPS):
            _step(w)
            after.append(_allocated())
        return after
    finally:
        core.eager.reset_saved_tensors_hooks()


def test_the_probe_keeps_no_step_alive(tmp_path):
    probe = dryrun_probe._Probe(str(tmp_path))
    after = _after_each_step(probe.pack, dryrun_probe._unpack)
    assert after[1:] == [after[0]] * (STEPS - 1), after


def test_the_probe_counts_what_it_keeps_no_longer(tmp_path):
    """The kept tensor shares the saved storage: packing allocates nothing."""
    probe = dryrun_probe._Probe(str(tmp_path))
    t = paddle.randn([1024, 1024])
    before = _allocated()
    kept = probe.pack(t)
    assert _allocated() == before and kept.data_ptr() == t.data_ptr()
