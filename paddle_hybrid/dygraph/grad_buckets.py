"""Persistent fused gradient buckets for dygraph data parallel (plain DP and each
pipeline stage's DP group).

Data and protocol are separate, as in Megatron-LM's param_and_grad_buffer:

* :class:`GradBucket` (data): one contiguous buffer made with the plugin's
  ``coalesce_tensor``; every parameter's ``.grad`` *is* a view into it, so
  backward accumulates straight into the buffer and nothing is concatenated or
  split per step.
* :class:`GradBuckets` (protocol): builds the buckets (reverse parameter order,
  to follow backprop), checks once that every rank of the group has the same
  layout, registers one backward hook per parameter, and syncs:
  :meth:`GradBuckets.start_grad_sync` (scale by 1/nranks, all_reduce) as soon as
  the last gradient of a bucket is final, :meth:`GradBuckets.finish_grad_sync`
  before the optimizer step.

Why the views survive: Paddle accumulates a new gradient into an existing,
initialised ``.grad`` in place.  Two things would replace the storage:
``Tensor.clear_gradient(set_to_zero=True)`` (marks the grad "fake empty", so the
next backward assigns a fresh tensor) and ``clear_gradient(False)`` (drops it).
The plugin therefore routes ``clear_gradient`` of a bucketed parameter to an
in-place zero (``_zero_grads``), whatever ``set_to_zero`` says: bucketed
gradients stay allocated by design.  Anything else that replaces a ``.grad``
is caught before the bucket's all_reduce (pointer check) and repaired by
re-coalescing that bucket with its current values (counted in
``stats()["view_repairs"]``).

Ordering: buckets are started strictly in index order (a bucket that becomes
ready early waits for the ones before it), so every rank issues the same
sequence of collectives even if hooks fire in a different order.  With
``accumulate_steps`` microbatches (pipeline) a parameter's gradient is final
after its ``accumulate_steps``-th hook, so there is one all_reduce per bucket
per step.  On gloo an all_reduce runs to completion inside the call (there is
no communication stream), so on CPU the gain is fewer, larger collectives and
no copies, not overlap; with NCCL the same calls overlap with backward.
"""
from __future__ import annotations

import contextlib
import weakref

import paddle
import paddle.distributed as dist

from .. import ops

__all__ = [
    "GradBucket",
    "GradBuckets",
    "BucketLayoutError",
    "GradSyncError",
    "plan_buckets",
    "buckets_of",
    "buckets_for_params",
    "is_bucketed",
    "all_bucket_sets",
]

# id(param) -> (weakref(param), GradBuckets)
_REGISTRY: dict[int, tuple] = {}
_ALL: "weakref.WeakSet[GradBuckets]" = weakref.WeakSet()

ALIGN_BYTES = 64  # each view starts on a cache line; small padding between parameters


class BucketLayoutError(RuntimeError):
    """The ranks of a data-parallel group built different gradient buckets."""


class GradSyncError(RuntimeError):
    """A gradient bucket could not be synchronised (peer died, misuse)."""


def _nbytes(p) -> int:
    return int(p._numel()) * p.element_size()


def plan_buckets(params, bucket_bytes: int, max_params: int = 0) -> list[list]:
    """Split ``params`` into buckets, in reverse order (backprop order).

    A bucket holds one dtype, at most ``bucket_bytes`` bytes of gradients and, when
    ``max_params > 0``, at most ``max_params`` parameters; a parameter larger than
    ``bucket_bytes`` gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes must be > 0, got {bucket_bytes}.")
    if max_params < 0:
        raise ValueError(f"plan_buckets: max_params must be >= 0 (0: no limit), got {max_params}.")
    buckets, cur, cur_bytes = [], [], 0
    for p in reversed(list(params)):
        size = _nbytes(p)
        full = cur and (cur[0].dtype != p.dtype or cur_bytes + size > bucket_bytes
                        or (max_params and len(cur) >= max_params))
        if full:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += size
    if cur:
        buckets.append(cur)
    return buckets


class GradBucket:
    """One contiguous gradient buffer; ``params[i].grad`` is ``views[i]``."""

    def __init__(self, index: int, params):
        self.index = index
        self.params = list(params)
        self._coalesce()

    def _coalesce(self):
        grads = []
        for p in self.params:
            g = p._grad_ivar()
            if g is None or not g._is_initialized():
                p._set_grad_ivar(paddle.zeros_like(p))
                g = p._grad_ivar()
            grads.append(g)
        # Existing gradient values are kept (copy_data); the grad tensors themselves become
        # views into the new buffer (``views[i]`` is ``params[i]``'s grad).
        self.views, self.buffer = ops.coalesce_tensor(grads, copy_data=True, use_align=True,
                                                      align_size=ALIGN_BYTES)
        self.ptrs = [v.data_ptr() for v in self.views]
        self.nbytes = int(self.buffer._numel()) * self.buffer.element_size()

    def layout(self):
        return [(self.index, p.name, tuple(p.shape), str(p.dtype).replace("paddle.", ""))
                for p in self.params]

    def ensure_views(self) -> int:
        """Make every parameter's grad a view of the buffer again if something replaced or
        dropped it (values kept); returns how many had to be repaired."""
        bad = 0
        for p, ptr in zip(self.params, self.ptrs):
            g = p._grad_ivar()
            if g is None or not g._is_initialized() or g.data_ptr() != ptr:
                bad += 1
        if bad:
            with paddle.no_grad():
                self._coalesce()
        return bad

    def zero_(self):
        with paddle.no_grad():
            self.buffer.zero_()


class GradBuckets:
    """Fused gradient buckets of ``params`` over a data-parallel ``group``.

    Args:
        params: parameters to bucket (those with ``stop_gradient`` are skipped).
        group: the data-parallel group (``None``: the global group).
        bucket_size_mb: bytes of gradients per bucket, in MiB (``fuse_grad_size_in_MB``).
        max_params: most parameters per bucket, 0 for no limit.
        accumulate_steps: backward passes per optimizer step (pipeline microbatches);
            a gradient is final after this many hooks.
        check_layout: compare the bucket layout across the group once, now.
    """

    def __init__(self, params, group=None, bucket_size_mb: float = 32, max_params: int = 0,
                 accumulate_steps: int = 1, check_layout: bool = True):
        if accumulate_steps < 1:
            raise ValueError(f"GradBuckets: accumulate_steps must be >= 1, got {accumulate_steps}.")
        if not bucket_size_mb > 0:
            raise ValueError(f"GradBuckets: bucket_size_mb must be > 0, got {bucket_size_mb}.")
        self.group = group
        self.nranks = group.nranks if group is not None else dist.get_world_size()
        self.accumulate_steps = int(accumulate_steps)
        seen, trainable = set(), []
        for p in params:
            if p.stop_gradient or id(p) in seen:
                continue
            if id(p) in _REGISTRY and _REGISTRY[id(p)][0]() is p:
                raise ValueError(f"GradBuckets: parameter {p.name} is already in gradient buckets; "
                                 "call remove() on those first.")
            seen.add(id(p))
            trainable.append(p)
        if not trainable:
            raise ValueError("GradBuckets: no trainable parameters to bucket.")
        plan = plan_buckets(trainable, int(bucket_size_mb * 1024 * 1024), max_params)
        self.buckets = [GradBucket(i, ps) for i, ps in enumerate(plan)]
        self._where = {}  # id(param) -> (bucket index, position)
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self._where[id(p)] = (b.index, j)
        if check_layout and self.nranks > 1:
            self._check_layout()
        self._flat_params = [p for b in self.buckets for p in b.params]
        self._flat = {(b.index, j): k for k, (b, j) in enumerate(
            (b, j) for b in self.buckets for j in range(len(b.params)))}
        self._counts = [0] * len(self._flat_params)
        self._pending = [len(b.params) for b in self.buckets]
        self._ready = [False] * len(self.buckets)
        self._next = 0  # next bucket to start, in index order
        self._tasks = {}
        self._removed = False
        self._paused = False
        self.error = None  # the exception a backward hook raised, if any
        self._stats = {"steps": 0, "bucket_syncs": 0, "started_in_backward": 0, "view_repairs": 0}
        for b in self.buckets:
            for j, p in enumerate(b.params):
                p._register_backward_hook(self._make_hook(b.index, j))
                _REGISTRY[id(p)] = (weakref.ref(p), self)
        _ALL.add(self)

    # -- layout ------------------------------------------------------------
    def layout(self):
        return [entry for b in self.buckets for entry in b.layout()]

    def _check_layout(self):
        mine = self.layout()
        gathered = []
        dist.all_gather_object(gathered, mine, group=self.group)
        ranks = self.group.ranks if self.group is not None else list(range(self.nranks))
        ref = gathered[0]
        for r, other in enumerate(gathered[1:], start=1):
            if other == ref:
                continue
            for k in range(max(len(ref), len(other))):
                a = ref[k] if k < len(ref) else None
                b = other[k] if k < len(other) else None
                if a != b:
                    raise BucketLayoutError(
                        f"gradient buckets differ across the data-parallel group {ranks}: entry {k} "
                        f"(bucket, parameter, shape, dtype) is {a} on rank {ranks[0]} but {b} on rank "
                        f"{ranks[r]}. Every rank of the group must build the same model with the same "
                        "trainable parameters (parameter "
                        f"{(a or b)[1]!r}); to run without buckets set strategy.fuse_all_reduce_ops=False.")

    # -- hooks -------------------------------------------------------------
    def _make_hook(self, bi, j):
        ref = weakref.ref(self)
        k = self._flat[(bi, j)]

        def hook(*_):
            self_ = ref()
            if self_ is None or self_._removed or self_._paused:
                return  # gone, removed, or inside no_sync(): gradients accumulate locally
            try:
                self_._grad_ready(bi, k)
            except Exception as exc:
                # Paddle reports an exception raised in a backward hook only as a SystemError;
                # keep it, and raise it again from finish_grad_sync().
                self_.error = exc
                raise

        return hook

    def _grad_ready(self, bi, k):
        counts = self._counts
        counts[k] += 1
        if counts[k] != self.accumulate_steps:
            if counts[k] > self.accumulate_steps:
                raise GradSyncError(
                    f"gradient of {self._flat_params[k].name} was produced {counts[k]} times since the "
                    f"last optimizer step, but the buckets expect {self.accumulate_steps} backward "
                    "pass(es) per step. Call the fleet optimizer's step() (it finishes the gradient "
                    "sync) after each step, or set strategy.fuse_all_reduce_ops=False for manual "
                    "gradient accumulation.")
            return
        self._pending[bi] -= 1
        if self._pending[bi] == 0:
            self._ready[bi] = True
            while self._next < len(self.buckets) and self._ready[self._next]:
                self.start_grad_sync(self.buckets[self._next])
                self._stats["started_in_backward"] += 1
                self._next += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally and do not count towards
        ``accumulate_steps`` (like ``paddle.DataParallel.no_sync``)."""
        prev, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = prev

    # -- protocol ------------------------------------------------------------
    def start_grad_sync(self, bucket: GradBucket):
        """Average ``bucket`` over the group: scale by 1/nranks, then all_reduce (sum),
        the same arithmetic as Paddle's ``fused_allreduce_gradients``."""
        if bucket.index in self._tasks:
            raise GradSyncError(f"bucket {bucket.index} was started twice in one step.")
        self._stats["view_repairs"] += bucket.ensure_views()
        try:
            with paddle.no_grad():
                if self.nranks > 1:
                    bucket.buffer.scale_(1.0 / self.nranks)
                    self._tasks[bucket.index] = dist.all_reduce(bucket.buffer, group=self.group, sync_op=False)
                else:  # one rank: nothing to exchange
                    self._tasks[bucket.index] = None
        except Exception as exc:
            raise self._sync_error(bucket, exc) from exc
        self._stats["bucket_syncs"] += 1

    def finish_grad_sync(self):
        """Start every bucket not yet started (in order), wait for all, and reset for the next step."""
        if self.error is not None:
            raise self.error
        while self._next < len(self.buckets):
            self.start_grad_sync(self.buckets[self._next])
            self._next += 1
        for bi in sorted(self._tasks):
            if self._tasks[bi] is None:
                continue
            try:
                self._tasks[bi].wait()
            except Exception as exc:
                raise self._sync_error(self.buckets[bi], exc) from exc
        self._tasks.clear()
        self._counts = [0] * len(self._flat_params)
        self._pending = [len(b.params) for b in self.buckets]
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._stats["steps"] += 1

    def _sync_error(self, bucket, exc):
        ranks = self.group.ranks if self.group is not None else list(range(self.nranks))
        return GradSyncError(
            f"all_reduce of gradient bucket {bucket.index} ({len(bucket.params)} parameters from "
            f"{bucket.params[0].name}, {bucket.nbytes} bytes) over ranks {ranks} failed: {exc}. "
            "Another rank of the data-parallel group probably exited or stopped before this step.")

    def zero_grad(self):
        for b in self.buckets:
            b.zero_()

    def covers(self, param) -> bool:
        return id(param) in self._where

    def stats(self) -> dict:
        """Counters: ``steps`` (finish_grad_sync calls), ``bucket_syncs`` (buckets started; one
        all_reduce each when the group has > 1 rank), ``started_in_backward`` (of those, started
        by a hook), ``view_repairs``; and the layout: ``num_buckets``, ``buckets``, ``num_params``."""
        out = dict(self._stats)
        out["num_buckets"] = len(self.buckets)
        out["buckets"] = [{"params": len(b.params), "bytes": b.nbytes} for b in self.buckets]
        out["num_params"] = len(self._where)
        return out

    def remove(self):
        """Stop syncing: hooks become no-ops and the parameters leave the registry
        (their gradients stay views of the buffers until something replaces them)."""
        self._removed = True
        for b in self.buckets:
            for p in b.params:
                entry = _REGISTRY.get(id(p))
                if entry is not None and entry[1] is self:
                    del _REGISTRY[id(p)]
        _ALL.discard(self)


def is_bucketed(param) -> bool:
    entry = _REGISTRY.get(id(param))
    return entry is not None and entry[0]() is param


def buckets_for_params(params) -> tuple[list, list]:
    """(bucket sets covering any of ``params``, the params no bucket set covers)."""
    sets, rest, seen = [], [], set()
    for p in params:
        entry = _REGISTRY.get(id(p))
        if entry is not None and entry[0]() is p:
            if id(entry[1]) not in seen:
                seen.add(id(entry[1]))
                sets.append(entry[1])
        else:
            rest.append(p)
    return sets, rest


def buckets_of(model):
    """The :class:`GradBuckets` that ``fleet.distributed_model`` attached to ``model``, or None."""
    return getattr(model, "_ph_grad_buckets", None)


def all_bucket_sets() -> list:
    return list(_ALL)
