"""Stand-ins the gradient-bucket tests share (tests and their workers import this file).

* :class:`DelayedAllReduce` replaces ``paddle.distributed.all_reduce``.  An asynchronous call
  (``sync_op=False``, what the buckets issue) returns a task and does **not** reduce yet: the
  data on the wire is what the tensor held at the call, and the result is written into the
  tensor only by ``task.wait()``, overwriting anything written in between.  That is what NCCL
  does on its own stream; gloo instead finishes inside the call, which hides a reader that
  runs before the wait.  With a :class:`FakeGroup` the other rank is simulated in one process
  (its contribution is ``other(snapshot)``, by default a gradient that differs from this
  rank's: :func:`differing_replicas`); with a real group the wait runs the real
  all_reduce, so ranks pair up in wait order.
* :class:`FakeGroup`: a two-rank data-parallel group inside one process.
* :func:`bucket_code_calls`: which functions of the bucket package ran during a call.
* :func:`cpu_grad_scaler`: a ``paddle.amp.GradScaler`` that really scales, unscales and checks
  for inf/nan on CPU (Paddle switches the scaler off on a CPU place).
"""
from __future__ import annotations

import contextlib
import os
import sys

import paddle
import paddle.distributed as dist


def differing_replicas(nranks=2):
    """``other(x)`` for ranks whose gradients differ from this rank's ``x``: rank r >= 1 sends
    ``(1 + 2r) x + r/4``.  Not a common factor of ``x``, so a bucket that skips the 1/nranks
    scale, the reduce, or both gives wrong numbers (with identical replicas, skipping both
    leaves the right average in place)."""

    def other(x):
        total = None
        for r in range(1, nranks):
            term = (1 + 2 * r) * x + 0.25 * r
            total = term if total is None else total + term
        return total

    return other


class FakeGroup:
    """``nranks`` ranks in one process; ``other(x)`` is the sum of what the other ranks send when
    this rank sends ``x`` (default: :func:`differing_replicas`)."""

    def __init__(self, nranks=2, other=None):
        if nranks < 2:
            raise ValueError(f"FakeGroup: nranks must be >= 2 (one rank needs no group), got {nranks}.")
        self.nranks = nranks
        self.ranks = list(range(nranks))
        self.id = -1
        self.other = other or differing_replicas(nranks)


class _Task:
    def __init__(self, finish):
        self._finish, self.done = finish, False

    def wait(self):
        if not self.done:
            self._finish()
            self.done = True
        return True

    def is_completed(self):
        return self.done


class DelayedAllReduce:
    """Drop-in for ``paddle.distributed.all_reduce`` (see the module doc).  ``calls`` records,
    for every asynchronous call, the snapshot sent (``numpy``) and the call's position in
    ``events`` (tests append their own markers to ``events``)."""

    def __init__(self, real=None, immediate=False):
        self.real = real or dist.all_reduce
        self.immediate = immediate  # True: complete inside the call, like gloo
        self.calls: list[dict] = []
        self.events: list = []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, sync_op=True):
        if sync_op and not isinstance(group, FakeGroup):
            return self.real(tensor, op=op, group=group, sync_op=True)
        with paddle.no_grad():
            snapshot = tensor.clone()
        self.calls.append({"sent": snapshot.numpy().copy(), "event": len(self.events)})
        self.events.append(("all_reduce", len(self.calls) - 1))

        def finish():
            with paddle.no_grad():
                if isinstance(group, FakeGroup):
                    reduced = snapshot + group.other(snapshot)
                else:
                    reduced = snapshot
                    self.real(reduced, op=op, group=group, sync_op=True)
                tensor.copy_(reduced, False)

        task = _Task(finish)
        if sync_op or self.immediate:
            task.wait()
        return task


@contextlib.contextmanager
def delayed_all_reduce(immediate=False):
    """Patch ``paddle.distributed.all_reduce`` with a :class:`DelayedAllReduce` (yielded)."""
    fake = DelayedAllReduce(immediate=immediate)
    original = dist.all_reduce
    dist.all_reduce = fake
    try:
        yield fake
    finally:
        dist.all_reduce = original


class _GpuLikePlace:
    def is_gpu_place(self):
        return True

    def is_xpu_place(self):
        return False

    def is_custom_place(self):
        return False


class _TracerProxy:
    def __init__(self, tracer):
        self._tracer = tracer
        self._expected_place = _GpuLikePlace()

    def __getattr__(self, name):
        return getattr(self._tracer, name)


def cpu_grad_scaler(init_loss_scaling=1024.0):
    """A GradScaler with a static loss scale that is enabled on CPU: ``scale`` multiplies,
    ``step``/``minimize`` unscale in place and skip the update on inf/nan, as on a GPU."""
    from paddle.amp import grad_scaler

    real = grad_scaler._dygraph_tracer
    grad_scaler._dygraph_tracer = lambda: _TracerProxy(real())
    try:
        scaler = paddle.amp.GradScaler(init_loss_scaling=init_loss_scaling, use_dynamic_loss_scaling=False)
    finally:
        grad_scaler._dygraph_tracer = real
    assert scaler.is_enable()
    return scaler


class SyncingOptimizer:
    """What ``HybridParallelOptimizer`` does for a bucketed model: ``step()`` first finishes
    the buckets' gradient sync (``_hybrid_sync_grad``), then steps the inner optimizer."""

    def __init__(self, inner, buckets):
        self._inner_opt, self._buckets = inner, buckets

    def step(self):
        self._buckets.finish_grad_sync()
        self._inner_opt.step()

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        self._buckets.finish_grad_sync()
        return self._inner_opt.minimize(loss, startup_program, parameters, no_grad_set)

    def __getattr__(self, name):
        return getattr(self._inner_opt, name)


def bucket_code_calls(fn, only_called_by_paddle=False):
    """Names of the functions of the bucket package that ran during ``fn()``; with
    ``only_called_by_paddle``, only those Paddle itself called (hooks, patched methods), not
    the ones the test called."""
    import paddle_hybrid

    folder = os.path.dirname(sys.modules[paddle_hybrid.GradBuckets.__module__].__file__)
    paddle_folder = os.path.dirname(paddle.__file__)
    seen = []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(folder):
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if not only_called_by_paddle or caller.startswith(paddle_folder):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen
