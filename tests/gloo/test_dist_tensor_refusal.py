"""A DistTensor handed to a gloo process group is refused with a message (``gloo.errors``): stock
Paddle reads it as a dense tensor and the process dies of a segmentation fault, no message."""
import os

import paddle
import pytest

from paddle_hybrid.gloo import errors
from paddle_hybrid.testing import LaunchError, launch

HERE = os.path.dirname(os.path.abspath(__file__))


class _DistLike(paddle.Tensor):
    """Answers ``is_dist()`` as a DistTensor does.  A real one is not made in this process: making a
    ProcessMesh and a DistTensor leaves process-wide auto-parallel state that broke the static
    reshard tests run later in the same pytest process (the two-rank test below uses real ones)."""

    def is_dist(self):
        return True


def _dist_tensor():
    return _DistLike(paddle.ones([2, 2]))


def test_the_wrapper_refuses_before_calling_gloo():
    calls = []
    wrapped = errors._make_named("all_gather", lambda self, *a, **k: calls.append(a), config=None)
    dense = paddle.ones([2])
    with pytest.raises(errors.GlooDistTensorError, match=r"all_gather .* DistTensor \(argument 0\[1\]\)"):
        wrapped(object(), [dense, _dist_tensor()], dense)
    with pytest.raises(errors.GlooDistTensorError, match=r"argument 'tensor'"):
        wrapped(object(), tensor=_dist_tensor())
    assert calls == []
    wrapped(object(), [dense], dense)
    assert len(calls) == 1


def test_two_ranks_get_the_error_and_keep_training():
    for r in launch(os.path.join(HERE, "worker_dist_tensor.py"), nprocs=2, timeout=120):
        assert r["error"] == "GlooDistTensorError" and "tensor._local_value()" in r["message"], r
        assert r["dense"] == [3.0, 3.0]


def test_stock_paddle_crashes_on_it():
    # what the check replaces: no Python error at all, the ranks die of a signal
    with pytest.raises(LaunchError) as failure:
        launch(os.path.join(HERE, "worker_dist_tensor.py"), nprocs=2, timeout=120, env={"WITH_PLUGIN": "0"})
    assert "GlooDistTensorError" not in str(failure.value)
