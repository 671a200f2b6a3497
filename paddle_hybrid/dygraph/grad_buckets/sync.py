"""The sync protocol of gradient buckets over a data-parallel group (:class:`GradBuckets`).

Data lives in :mod:`.bucket` (a fused buffer per bucket, every parameter's gradient an alias
of its view); readiness in :mod:`.readiness`.  This module:

* builds the buckets (reverse parameter order, to follow backprop) and checks once that
  every rank of the group laid them out the same (:func:`paddle_hybrid.common.layout_check.
  gather_and_compare`);
* hangs one removable gradient hook on every parameter; a hook says "parameter k fired" and,
  once Paddle has added the gradient (:mod:`.backward_end`), "k accumulated";
* starts a bucket (scale by 1/nranks, asynchronous all_reduce: Paddle's own arithmetic) when
  :class:`~.readiness.Readiness` says all its gradients are final, strictly in index order
  so every rank issues the same sequence of collectives;
* :meth:`GradBuckets.finish_grad_sync` starts what is left and waits for every bucket.  With
  ``finish_at_backward_end`` (plain data parallel) that happens at the end of every backward
  pass of a last microbatch, so anything that reads gradients after ``backward()`` returns
  (a GradScaler's unscale and inf check, clipping, ``fused_allreduce_gradients``, the
  optimizer) sees finished, averaged buckets, on NCCL as on gloo.  A pipeline finishes at the
  end of its schedule instead (:mod:`.wiring`).

A repeated sync is harmless: a backward outside ``no_sync()`` after a finished sync adds its
local gradient onto the average and the next sync averages again, which is the average of
both (what Paddle's DataParallel reducer gives too).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import paddle
import paddle.distributed as dist

from ...common.layout_check import DEFAULT_TIMEOUT, gather_and_compare
from . import backward_end
from .bucket import Bucket, plan_buckets
from .readiness import Readiness

__all__ = ["GradBuckets", "BucketLayoutError", "GradSyncError", "is_bucketed", "buckets_for_params",
           "all_bucket_sets"]

# id(param) -> (weakref(param), GradBuckets): who syncs a parameter's gradient
_REGISTRY: dict[int, tuple] = {}
_ALL: "weakref.WeakSet[GradBuckets]" = weakref.WeakSet()


class BucketLayoutError(RuntimeError):
    """The ranks of a data-parallel group built different gradient buckets."""


class GradSyncError(RuntimeError):
    """A gradient bucket could not be synchronised (peer died, misuse)."""


class GradBuckets:
    """Fused gradient buckets of ``params`` over a data-parallel ``group``.

    Args:
        params: parameters to bucket (those with ``stop_gradient`` are skipped).  If every
            one has a ``main_grad`` attribute (fleet's ``MixPrecisionLayer``), the buckets hold
            ``main_grad`` (fp32) and ``param.grad`` stays empty.
        group: the data-parallel group (``None``: the global group).
        bucket_size_mb: MiB of gradients per bucket (``strategy.fuse_grad_size_in_MB``).
        max_params: most parameters per bucket, 0 for no limit.
        check_layout: compare the bucket layout across the group once, now.
        finish_at_backward_end: finish the sync when a backward pass of a last microbatch
            ends (plain data parallel); False: the owner calls :meth:`finish_grad_sync`.
        layout_timeout: seconds the layout check waits for the other ranks.

    ``is_last_microbatch`` (default True) says whether the gradients of the current
    microbatch are the last before a sync; :meth:`no_sync` clears it for a block.
    """

    def __init__(self, params, group=None, bucket_size_mb: float = 32, max_params: int = 0,
                 check_layout: bool = True, finish_at_backward_end: bool = True,
                 layout_timeout: float = DEFAULT_TIMEOUT):
        if not bucket_size_mb > 0:
            raise ValueError(f"GradBuckets: bucket_size_mb must be > 0, got {bucket_size_mb}.")
        self.group = group
        self.nranks = group.nranks if group is not None else dist.get_world_size()
        self.finish_at_backward_end = finish_at_backward_end
        trainable = _select(params)
        self.main_grad = _uses_main_grad(trainable)
        # Phase 1, data: plan and build every bucket (values of existing gradients kept).
        plan = plan_buckets(trainable, int(bucket_size_mb * 1024 * 1024), max_params, self.main_grad)
        self.buckets = [Bucket(i, ps, self.main_grad) for i, ps in enumerate(plan)]
        self._flat = [(b.index, p) for b in self.buckets for p in b.params]
        self._slot = [(b, i) for b in self.buckets for i in range(len(b.params))]  # flat k -> (bucket, i)
        self._index = {id(p): k for k, (_, p) in enumerate(self._flat)}
        # Phase 2, agree: every rank must pair the same bytes.
        if check_layout and self.nranks > 1:
            self._check_layout(layout_timeout)
        # Phase 3, protocol state, then hooks (last: nothing fires on a half-built set).
        self._readiness = Readiness([b for b, _ in self._flat], [len(b.params) for b in self.buckets])
        self._next = 0  # next bucket to start, in index order
        self._tasks: dict[int, object] = {}
        self._dirty = False  # gradients added since the last finished sync
        self._removed = self._aside = self._remove_after_pass = self._in_pass = False
        self._on_remove: list = []
        # the exception a hook raised: raised from the failed backward itself (backward_end),
        # else (no wrapped backward, or a broken group) once by finish_grad_sync()
        self.error = None
        self._stats = dict.fromkeys(("steps", "bucket_syncs", "started_by_hook", "started_at_backward_end",
                                     "started_at_finish", "started_at_abort", "view_repairs"), 0)
        self._hook_calls = 0
        self._released = False  # gradients were dropped (clear_grad(set_to_zero=False)): re-bind at hooks
        self._handles = [p.register_hook(_make_hook(self, k)) for k, (_, p) in enumerate(self._flat)]
        for _, p in self._flat:
            _REGISTRY[id(p)] = (weakref.ref(p), self)
        _ALL.add(self)

    # -- layout ------------------------------------------------------------------------
    def layout(self) -> list[tuple]:
        return [entry for b in self.buckets for entry in b.layout()]

    def _check_layout(self, timeout: float) -> None:
        gather_and_compare(
            self.layout(), group=self.group, timeout=timeout, what="gradient-bucket layout",
            describe=lambda e: f"bucket {e[0]}: parameter {e[1]!r} shape {e[2]} {e[3]}",
            fix="Every rank of the data-parallel group must build the same model with the same trainable "
                "parameters; to run without buckets set strategy.fuse_all_reduce_ops=False.",
            error=BucketLayoutError)

    # -- readiness signals ---------------------------------------------------------------
    @property
    def is_last_microbatch(self) -> bool:
        return self._readiness.is_last_microbatch

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self._readiness.is_last_microbatch = bool(value)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally; the next one outside syncs
        (like ``paddle.DataParallel.no_sync``)."""
        prev, self.is_last_microbatch = self.is_last_microbatch, False
        try:
            yield
        finally:
            self.is_last_microbatch = prev

    def mark_grad_ready(self, param) -> None:
        """Declare ``param``'s gradient final for this window: for an owner that knows (its
        bucket may start at once)."""
        k = self._index.get(id(param))
        if k is None:
            raise ValueError(f"GradBuckets.mark_grad_ready: {param.name} is not in these buckets.")
        self._dirty = True
        if self._readiness.finalize(k):
            self._start_ready("started_by_hook")

    def _hook(self, k: int) -> None:
        """Parameter ``k``'s gradient hook: runs before Paddle adds the gradient.  (Hot: once
        per parameter per backward pass.)"""
        s = backward_end.state()
        if s["pending"]:
            backward_end.flush()  # the previous hook's gradient is in by now
        if self._aside:
            return
        if not self._in_pass:  # first hook of this set in this pass
            self._in_pass = True
            backward_end.take_part(self)
            p = self._flat[k][1]
            if not self.main_grad and hasattr(p, "main_grad"):  # MixPrecisionLayer wraps all at once
                return self._step_aside(p)
        self._hook_calls += 1
        self._dirty = True
        if self._released:
            self._slot[k][0].rebind(self._slot[k][1])  # before Paddle adds: it adds into the view
        if self._readiness.fire(k) and self._flat[k][0] < self._next:
            raise GradSyncError(
                f"gradient of {self._flat[k][1].name} got another contribution after its bucket's all_reduce "
                "started (its hook fires a varying number of times per backward pass). Set "
                "strategy.fuse_all_reduce_ops=False for this model.")
        s["pending"].append((self, k))

    def _accumulated(self, k: int) -> None:
        if not self._aside and self._readiness.accumulated(k):
            self._start_ready("started_by_hook")

    def release_grads(self, params) -> None:
        """``params``' gradients were dropped (``clear_grad(set_to_zero=False)``): ``.grad`` is
        None as Paddle promises, the buffers keep their memory (the next backward needs it
        anyway), and each gradient becomes a view again, zeroed, in its hook on the next
        backward, before Paddle adds into it: no new tensor, no copy.  (A parameter that gets
        no gradient is put back when its bucket starts, by :meth:`Bucket.ensure_bound`.)"""
        for p in params:
            if self._index.get(id(p)) is None:
                raise ValueError(f"GradBuckets.release_grads: {p.name} is not in these buckets.")
        self._released = True

    def _backward_done(self) -> None:
        self._in_pass = False
        if self._aside or self._remove_after_pass:
            return self.remove()
        self._readiness.backward_done()
        self._start_ready("started_at_backward_end")
        if self.finish_at_backward_end and self.is_last_microbatch:
            self.finish_grad_sync()

    def _backward_aborted(self):
        """A backward pass raised.  Leave the set ready for the next step and return the
        exception one of our hooks raised (None if the error was not ours), for
        :func:`.backward_end.wrap_backward` to raise in place of Paddle's generic one.

        What happens to the sync window, and why (a multi-rank abort):

        * Buckets already started are waited for.  With NCCL the reduction lands in the
          buffer whenever the stream gets to it; abandoned, it could overwrite a later
          ``clear_grad()``'s zeros or the next step's gradients.  On gloo the all_reduce
          completed inside its call (the peers issued theirs), so the wait costs nothing.
        * In a last microbatch, the buckets not started yet are started now, in order, and
          waited for.  Every rank must issue each bucket's all_reduce exactly once per
          sync, in index order: the other ranks do not know this one failed and issue all
          of theirs; were this rank to issue fewer, its next step's collectives would pair
          with their leftovers (a hang, or steps silently mixed).  If every rank failed,
          every rank completes the sequence: still paired.  The price: the other ranks'
          average of this step includes this rank's partial gradients.  As with Paddle's
          and PyTorch's data parallel, a training loop that goes on after a failed backward
          must agree across ranks (e.g. all_reduce a failure flag) to skip the step
          everywhere, and clear the gradients: they are partial here.
        * All per-pass and per-window state is reset (readiness, tasks, next bucket, the
          stored error): the next step starts clean.  What was learned from complete passes
          (one contribution per pass) is kept.

        Not covered: a pass that raised before any of this set's hooks ran never reaches
        here; in a last microbatch the other ranks then wait for collectives this rank
        never issues (as with stock data parallel).
        """
        self._in_pass = False
        error, self.error = self.error, None
        self._readiness.backward_aborted()
        if self._aside or self._remove_after_pass:
            self.remove()
            return error
        if self.is_last_microbatch or self._next > 0:
            try:
                self._complete_window("started_at_abort")
            except GradSyncError as exc:  # the group is broken: the next finish says so
                self.error = exc
            self._reset_window()
        # else: an earlier microbatch (nothing starts there): only the pass is forgotten
        return error

    # -- protocol ----------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Every gradient is final: start every bucket not started yet, in order."""
        self._start_rest("started_at_finish")

    def _start_rest(self, how: str) -> None:
        if not self._dirty:
            return  # nothing new since the last sync: the buffers hold the average already
        self._readiness.finalize_all()
        self._start_ready(how)

    def finish_grad_sync(self) -> None:
        """Start what is left, wait for every bucket, open the next window.  A no-op when no
        gradient was added since the last finished sync."""
        if self.error is not None:
            # raised once: the window it broke is dropped, the next step starts clean
            error, self.error = self.error, None
            with contextlib.suppress(GradSyncError):
                self._wait_started()  # a late result must not land in the next step's buffers
            self._reset_window()
            raise error
        backward_end.flush()
        if self._remove_after_pass:
            return self.remove()
        synced = self._dirty
        self._complete_window("started_at_finish")
        if synced:
            self._stats["steps"] += 1
        self._reset_window()

    def _complete_window(self, how: str) -> None:
        """Start every bucket not started yet (if gradients were added), wait for all."""
        self._start_rest(how)
        if self._next == len(self.buckets):
            self._released = False  # every bucket was started: every gradient is a view again
        self._wait_started()

    def _wait_started(self) -> None:
        for b in sorted(self._tasks):
            if self._tasks[b] is None:
                continue
            try:
                self._tasks[b].wait()
            except Exception as exc:
                raise self._sync_error(self.buckets[b], exc) from exc

    def _reset_window(self) -> None:
        """Forget the sync window (started tasks must be waited for already)."""
        self._tasks.clear()
        self._readiness.new_window()
        self._next, self._dirty, self._in_pass = 0, False, False

    def _start_ready(self, how: str) -> None:
        while self._next < len(self.buckets) and self._readiness.complete(self._next):
            self._start(self.buckets[self._next], how)
            self._next += 1

    def _start(self, bucket: Bucket, how: str) -> None:
        """Average ``bucket`` over the group: scale by 1/nranks, then an asynchronous
        all_reduce (sum): the arithmetic of Paddle's ``fused_allreduce_gradients``."""
        self._stats["view_repairs"] += bucket.ensure_bound()
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
        self._stats[how] += 1

    def _sync_error(self, bucket, exc):
        ranks = self.group.ranks if self.group is not None else list(range(self.nranks))
        return GradSyncError(
            f"all_reduce of gradient bucket {bucket.index} ({len(bucket.params)} parameters from "
            f"{bucket.params[0].name}, {bucket.nbytes} bytes) over ranks {ranks} failed: {exc}. "
            "Another rank of the data-parallel group probably exited or stopped before this step.")

    # -- leaving ---------------------------------------------------------------------------
    def _step_aside(self, param) -> None:
        """Fleet's main_grad recipe was applied after the buckets were built: they cannot hold
        ``main_grad`` now.  Hand every gradient back to the recipe (its hook, next in line,
        asserts ``param.grad`` is empty) and leave after this pass: a hook may not be removed
        while it runs."""
        warnings.warn(f"paddle_hybrid: gradient buckets step aside: {param.name} got a main_grad "
                      "(MixPrecisionLayer) after the buckets were built; apply MixPrecisionLayer before "
                      "fleet.distributed_model to keep them.", RuntimeWarning, stacklevel=2)
        self._aside = self._remove_after_pass = True
        self._unregister()
        for _, p in self._flat:
            p.clear_gradient(False)  # no longer registered: Paddle's own clear drops the alias
        backward_end.take_part(self)

    def on_remove(self, fn) -> None:
        """Run ``fn()`` in :meth:`remove` (newest first): the owner's undo of its wiring."""
        self._on_remove.append(fn)

    def remove(self) -> None:
        """Stop syncing: take every hook off, leave the registry, run the owner's undo.
        Gradients stay aliases of the buffers until something replaces them.  Not from inside
        a hook (Paddle cannot remove a hook while it runs)."""
        if self._removed:
            return
        self._removed = self._aside = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._unregister()
        _ALL.discard(self)
        while self._on_remove:
            self._on_remove.pop()()

    def _unregister(self) -> None:
        for _, p in self._flat:
            entry = _REGISTRY.get(id(p))
            if entry is not None and entry[1] is self:
                del _REGISTRY[id(p)]

    # -- reporting ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters: ``steps`` (syncs finished), ``bucket_syncs`` (buckets started, one all_reduce
        each with > 1 rank), of those ``started_by_hook`` (during backward),
        ``started_at_backward_end``, ``started_at_finish`` and ``started_at_abort`` (completing
        the sequence after a failed backward); ``view_repairs`` (gradients put
        back into a buffer), ``hook_calls``; the layout: ``num_buckets``, ``buckets``,
        ``num_params``."""
        out = dict(self._stats, hook_calls=self._hook_calls)
        out["num_buckets"] = len(self.buckets)
        out["buckets"] = [{"params": len(b.params), "bytes": b.nbytes} for b in self.buckets]
        out["num_params"] = len(self._flat)
        return out


def _select(params) -> list:
    """Trainable parameters, once each; a parameter already in buckets is an error."""
    seen, out = set(), []
    for p in params:
        if p.stop_gradient or id(p) in seen:
            continue
        if is_bucketed(p):
            raise ValueError(f"GradBuckets: parameter {p.name} is already in gradient buckets; "
                             "call remove() on those first.")
        seen.add(id(p))
        out.append(p)
    if not out:
        raise ValueError("GradBuckets: no trainable parameters to bucket.")
    return out


def _uses_main_grad(params) -> bool:
    has = [hasattr(p, "main_grad") for p in params]
    if any(has) and not all(has):
        raise ValueError("GradBuckets: some parameters have a main_grad (MixPrecisionLayer) and some do "
                         "not; bucket them separately.")
    return all(has)


def _make_hook(owner: GradBuckets, k: int):
    ref = weakref.ref(owner)  # the hook must not keep a removed set alive

    def hook(grad):
        owner_ = ref()
        if owner_ is None:
            return None
        try:
            owner_._hook(k)
        except Exception as exc:
            # Paddle reports an exception raised in a hook only as a generic error; keep it,
            # and raise it again from finish_grad_sync().
            owner_.error = exc
            raise
        return None

    return hook


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


def all_bucket_sets() -> list:
    return list(_ALL)
