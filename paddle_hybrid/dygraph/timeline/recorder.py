"""Per-rank recording of a pipeline step: every forward and backward of every microbatch
(and VP chunk), every p2p exchange, the gradient sync and the optimizer update.

Recording hooks (through the timeline component's :class:`paddle_hybrid.registry.patching.Patcher`,
written against Paddle 3.3.1, undone by the registry):

- ``train_batch`` of ``PipelineParallel`` and ``PipelineParallelWithInterleave`` (1F1B,
  interleaved and F-then-B schedules): opens and closes a step; nothing is recorded outside.
- ``PipelineParallel._forward_step`` / ``_backward_step``: one ``forward`` / ``backward`` event
  each.  The microbatch is counted per (direction, chunk) within the step: every schedule of
  fleet runs a chunk's microbatches in order, forward and backward.
- ``p2p_communication._p2p_helper``: one ``comm`` event per exchange (named by what it sends and
  receives; it includes the wait when the schedule waits there, as gloo always does).
- ``PipelineLayer.allreduce_shared_weight_gradients``, and ``HybridParallelOptimizer.step``
  up to its ``_step``: ``grad_sync`` (shared weights across stages; data-parallel gradients,
  fleet's or the plugin's buckets); ``HybridParallelOptimizer._step``: ``optimizer``.

Clocks, chosen by where the run is (:func:`choose_clock`), not by how Paddle was compiled: on a
CPU run the wall clock (``time.perf_counter``), read when an event starts and ends.  On a GPU
run, device events recorded on the current stream and turned into seconds after the step (one
synchronize per step), so a span is the device time of the work it launched: written against
Paddle's documented ``paddle.device.Event`` and never executed (no GPU build ran here), so it
is used only on an explicit opt-in to the timeline, with a warning.
"""
from __future__ import annotations

import contextlib
import functools
import time

from ...common.pipeline_chunk import backward_chunk, takes_chunk_id
from ...common.schedule import Kind
from ._events import CAT_OF_KIND

__all__ = ["Recorder", "RECORDER", "install_hooks", "choose_clock"]


class _WallClock:
    def mark(self):
        return time.perf_counter()

    def resolve(self, marks):
        return list(marks)


class _CudaEventClock:
    """Device-time marks: an event per mark, converted after one synchronize per step,
    relative to the step's first mark, whose wall time anchors them."""

    def __init__(self):
        import paddle

        self._paddle = paddle
        self._anchor = None  # (event, wall seconds)

    def mark(self):
        event = self._paddle.device.Event(enable_timing=True)
        event.record()
        if self._anchor is None:
            self._anchor = (event, time.perf_counter())
        return event

    def resolve(self, marks):
        self._paddle.device.synchronize()
        anchor, wall = self._anchor
        self._anchor = None
        return [wall + anchor.elapsed_time(m) / 1000.0 for m in marks]


def choose_clock():
    """The wall clock on a CPU run; CUDA events on a GPU run (never executed: warned)."""
    import warnings

    from ...registry.device import cuda_build, running_on_cpu

    if running_on_cpu() or not cuda_build():
        return _WallClock()
    warnings.warn("paddle_hybrid.dygraph.timeline: recording with CUDA events, a clock written against Paddle's documented "
                  "API that has never run on a GPU; check the first trace against wall-clock step times.",
                  RuntimeWarning, stacklevel=3)
    return _CudaEventClock()


class Recorder:
    """Events of this rank: dicts ``{rank, step, name, cat, start, end, micro, chunk}``."""

    def __init__(self):
        self.events: list[dict] = []
        self.step = 0
        self.rank = 0
        self._active = False
        self._clock = None
        self._pending: list[tuple[dict, object, object]] = []
        self._micro_counts: dict = {}

    # -- step -------------------------------------------------------------------
    def begin_step(self, rank: int) -> bool:
        """Open a step (False if one is open already: a nested train_batch)."""
        if self._active:
            return False
        if self._clock is None:
            self._clock = choose_clock()
        self.rank, self._active, self._micro_counts = rank, True, {}
        return True

    def end_step(self) -> None:
        times = self._clock.resolve([m for _, start, end in self._pending for m in (start, end)])
        for i, (event, _, _) in enumerate(self._pending):
            event["start"], event["end"] = times[2 * i], times[2 * i + 1]
            self.events.append(event)
        self._pending, self._active = [], False
        self.step += 1

    def next_micro(self, cat: str, chunk) -> int:
        key = (cat, chunk)
        n = self._micro_counts.get(key, 0)
        self._micro_counts[key] = n + 1
        return n

    @contextlib.contextmanager
    def span(self, cat: str, name: str, micro=None, chunk=None):
        if not self._active:
            yield
            return
        event = {"rank": self.rank, "step": self.step, "name": name, "cat": cat, "micro": micro, "chunk": chunk}
        start = self._clock.mark()
        try:
            yield
        finally:
            self._pending.append((event, start, self._clock.mark()))

    def mark(self):
        return self._clock.mark() if self._active else None

    def add(self, cat: str, name: str, start_mark, end_mark) -> None:
        """An event between two marks taken earlier (a span that is not a ``with`` block)."""
        if self._active and start_mark is not None:
            event = {"rank": self.rank, "step": self.step, "name": name, "cat": cat, "micro": None,
                     "chunk": None}
            self._pending.append((event, start_mark, end_mark))

    def clear(self) -> None:
        self.events, self.step, self._pending, self._active = [], 0, [], False


RECORDER = Recorder()


# ---------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------

def _wrap_train_batch(orig):
    @functools.wraps(orig)
    def train_batch(self, *args, **kwargs):
        opened = RECORDER.begin_step(self.global_rank)
        try:
            return orig(self, *args, **kwargs)
        finally:
            if opened:
                RECORDER.end_step()

    return train_batch


def _wrap_compute(orig, kind: Kind):
    # The event format predates Action: cat "forward"/"backward", name the bare letter; the trace
    # labels each event with its whole action ("F3") through _events.compute_label.
    cat, name = CAT_OF_KIND[kind], str(kind)
    with_chunk_id = takes_chunk_id(orig)

    @functools.wraps(orig)
    def step(self, *args, **kwargs):
        chunk = kwargs.get("chunk_id")
        if chunk is None and kind is Kind.FORWARD and len(args) > 2:
            chunk = args[2]  # _forward_step(input_tensor, micro_dataset, chunk_id, ...)
        if chunk is None and kind is Kind.BACKWARD:
            chunk = backward_chunk(self, args, kwargs, with_chunk_id)
        micro = RECORDER.next_micro(cat, chunk)
        with RECORDER.span(cat, name, micro=micro, chunk=chunk):
            return orig(self, *args, **kwargs)

    return step


def _p2p_name(tensor_send_next, tensor_send_prev, recv_prev, recv_next) -> str:
    parts = [label for label, on in (("send_next", tensor_send_next is not None),
                                     ("send_prev", tensor_send_prev is not None),
                                     ("recv_prev", bool(recv_prev)), ("recv_next", bool(recv_next))) if on]
    return "+".join(parts) or "p2p"


def _wrap_p2p(orig):
    @functools.wraps(orig)
    def _p2p_helper(tensor_send_next, tensor_send_prev, recv_prev, recv_next, *args, **kwargs):
        with RECORDER.span("comm", _p2p_name(tensor_send_next, tensor_send_prev, recv_prev, recv_next)):
            return orig(tensor_send_next, tensor_send_prev, recv_prev, recv_next, *args, **kwargs)

    return _p2p_helper


def _wrap_shared_sync(orig):
    @functools.wraps(orig)
    def allreduce_shared_weight_gradients(self, *args, **kwargs):
        with RECORDER.span("grad_sync", "shared weights"):
            return orig(self, *args, **kwargs)

    return allreduce_shared_weight_gradients


def _wrap_opt_step(orig):
    @functools.wraps(orig)
    def step(self, *args, **kwargs):
        self._ph_timeline_sync_start = RECORDER.mark()
        try:
            return orig(self, *args, **kwargs)
        finally:
            self._ph_timeline_sync_start = None

    return step


def _wrap_opt_update(orig):
    @functools.wraps(orig)
    def _step(self, *args, **kwargs):
        # step() = gradient sync (fleet's, or the plugin's buckets finishing) then _step()
        start = getattr(self, "_ph_timeline_sync_start", None)
        RECORDER.add("grad_sync", "grad sync", start, RECORDER.mark())
        with RECORDER.span("optimizer", "optimizer"):
            return orig(self, *args, **kwargs)

    return _step


def install_hooks(patcher) -> None:
    """Wrap fleet's schedule, p2p and optimizer through ``patcher`` (the timeline component's,
    given by the registry, so ``paddle_hybrid.patches()`` lists them and ``uninstall()`` undoes
    them)."""
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import hybrid_parallel_optimizer as hpo_mod
    from paddle.distributed.fleet.meta_parallel import pipeline_parallel as pp
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    hpo = patcher.require(hpo_mod, "HybridParallelOptimizer", "hybrid_parallel_optimizer")
    schedules = [patcher.require(pp, name, "pipeline_parallel")
                 for name in ("PipelineParallel", "PipelineParallelWithInterleave")]
    base = schedules[0]
    for cls in schedules:
        patcher.check_params(vars(cls)["train_batch"], ["self", "data", "optimizer", "lr_scheduler", "scaler",
                                                        "loss_fn_idx", "return_micro_batch_loss"],
                             f"{cls.__name__}.train_batch")
    patcher.check_params(base._forward_step, ["self", "input_tensor", "micro_dataset", "chunk_id", "step_id",
                                              "overlap_schedule_mode"], "PipelineParallel._forward_step")
    backward_params = ["self", "input_tensor", "output_tensor", "output_tensor_grad", "chunk_id", "step_id",
                       "overlap_schedule_mode", "schedule_chunk", "loss_fn_node"]
    if not takes_chunk_id(base._backward_step):
        backward_params.remove("chunk_id")  # Paddle 3.2
    patcher.check_params(base._backward_step, backward_params, "PipelineParallel._backward_step")
    patcher.check_params(p2p._p2p_helper, ["tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next",
                                           "sync_recv", "send_recv_meta", "batch_p2p_comm", "wait_on_reqs",
                                           "dynamic_shape"], "p2p_communication._p2p_helper")
    patcher.require(pp_layers.PipelineLayer, "allreduce_shared_weight_gradients", "PipelineLayer")
    patcher.require(hpo, "_step", "HybridParallelOptimizer")

    for cls in schedules:
        patcher.set(cls, "train_batch", _wrap_train_batch(vars(cls)["train_batch"]))
    patcher.set(base, "_forward_step", _wrap_compute(base._forward_step, Kind.FORWARD))
    patcher.set(base, "_backward_step", _wrap_compute(base._backward_step, Kind.BACKWARD))
    patcher.set(p2p, "_p2p_helper", _wrap_p2p(p2p._p2p_helper))
    patcher.set(pp_layers.PipelineLayer, "allreduce_shared_weight_gradients",
                _wrap_shared_sync(pp_layers.PipelineLayer.allreduce_shared_weight_gradients))
    patcher.set(hpo, "step", _wrap_opt_step(hpo.step))
    patcher.set(hpo, "_step", _wrap_opt_update(hpo._step))
