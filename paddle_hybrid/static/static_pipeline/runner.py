"""Running one step of a legacy pipeline section program with micro-batches.

Paddle 3.3's ``Executor.run`` acts on ``program._pipeline_opt`` only for auto-parallel's
``standalone_opt``; for fleet's legacy pipeline it runs the unsplit program, and the section
program is reachable only through ``train_from_dataset``.  What is missing is device-independent,
and this module is it (the device rule gates it in :mod:`paddle_hybrid.static.static_pipeline`):

1. **Split** (once per program and fetch list): the section program (lowered for gloo on CPU, see
   :mod:`.lowering`) is cut by op role into four sub-programs, each op in program order: ``lr``
   (``LRSched``: learning-rate ops and the zeroing of the ``@MERGED`` accumulators, once per step),
   ``forward`` and ``backward`` (once per micro-batch), ``optimizer`` (once per step).  This is the
   execution model of Paddle's old section worker, which the send-wait checker also assumes.
2. **Plan**: one ``core.Job`` per entry of :func:`.schedule.job_order`, each forward/backward with
   its micro-batch id (the standalone executor gives every micro-batch its own scope), with
   Paddle's ``skip_gc_vars`` so a forward variable outlives its job until the last job of its
   micro-batch that reads it (a ``ph_nop`` of the send-wait rewrite counts as a reader, Paddle's
   built-in ``nop`` does not: ``pass_utils`` skips it).  Run by ``core.StandaloneExecutor`` with
   the settings of :data:`EXECUTOR_FLAGS`.
3. **Fetch**: a fetched forward variable is stacked per micro-batch (shape
   ``[accumulate_steps, *shape]``, as Paddle's own micro-batched executor path returns it): the
   forward sub-program writes it into a persistable buffer at a step counter.  A fetched variable
   computed on another stage (the loss, on every stage but the last) is broadcast from that stage,
   so every rank returns the same value.  A persistable variable returns its value after the step.

Data come from the program's own ``read`` op (a non-iterable ``DataLoader.from_generator``), one
micro-batch per forward job, or from ``feed``: each fed array (first dimension
``accumulate_steps x micro_batch_size``) is cut into the micro-batches, and the forward
sub-program reads row ``counter`` of it, like the fetch buffers.
"""
from __future__ import annotations

import numpy as np
import paddle
from paddle.base import core, framework

from ...config import DEFAULT_TIMEOUT
from ...common.program_edit import OpRole, deferred_sync, op_role
from .lowering import drain_all, lower_for_gloo, take_failure
from .schedule import BACKWARD, FORWARD, LR, OPTIMIZER, job_order

__all__ = ["SectionRunner", "phase_of", "split_by_phase", "is_pipeline_main", "is_pipeline_startup", "EXECUTOR_FLAGS"]

_COUNTER = "ph_pipeline_microbatch_counter"

EXECUTOR_FLAGS = {
    # The legacy interpreter: PIR translation of the section program would have to repair the
    # plugin's custom ops (see fused_allreduce.pir_repair); the legacy program runs as it is.
    "FLAGS_enable_pir_in_executor": False,
    # Built while first run: the CPU p2p ops are py_func ops, which cannot be built statically.
    "FLAGS_new_executor_static_build": False,
    # Ops in program order: a recv has no input, so only the order keeps it where the program
    # (and the peer's matching send) put it.
    "FLAGS_new_executor_serial_run": True,
}
_FETCH_SUFFIX = "@PH_PIPELINE_FETCH"
_FEED_SUFFIX = "@PH_PIPELINE_FEED"


def is_pipeline_main(program) -> bool:
    opt = getattr(program, "_pipeline_opt", None)
    return (isinstance(program, framework.Program) and bool(opt) and "section_program" in opt
            and "standalone_opt" not in opt)


def is_pipeline_startup(program) -> bool:
    opt = getattr(program, "_pipeline_opt", None)
    return isinstance(program, framework.Program) and bool(opt) and set(opt) == {"startup_program"}


def phase_of(op) -> str:
    """Job type of ``op`` by its role (see the module doc)."""
    role = op_role(op)
    if role & int(OpRole.LRSched):
        return LR
    if role & int(OpRole.Optimize):
        return OPTIMIZER
    if role & int(OpRole.Backward):
        return BACKWARD
    if role & ~int(OpRole.Loss) == int(OpRole.Forward):
        return FORWARD
    raise ValueError(f"paddle_hybrid.static.static_pipeline: op {op.type} has role {role:#x}, which no pipeline phase "
                     "runs (expected Forward, Backward, Optimize or LRSched).")


def split_by_phase(program) -> dict:
    """Job type -> a copy of ``program`` holding only that phase's ops (every variable kept)."""
    out = {}
    for job_type in (LR, FORWARD, BACKWARD, OPTIMIZER):
        sub = program.clone()
        block = sub.global_block()
        with deferred_sync(block):
            for idx in range(len(block.ops) - 1, -1, -1):
                if phase_of(block.ops[idx]) != job_type:
                    block._remove_op(idx)
        out[job_type] = sub
    return out


def _stage_of(main_program, name: str):
    """Stage whose ops produce ``name`` in the unsplit program (op_device ``gpu:K`` -> K), or None."""
    for op in main_program.global_block().ops:
        if name in op.output_arg_names and op.has_attr("op_device"):
            device = op.attr("op_device")
            if ":" in device and device.split(":")[1].isdigit():
                return int(device.split(":")[1])
    return None


class SectionRunner:
    """Runs steps of one pipeline ``main_program`` (fleet's, after ``minimize``) on this rank."""

    def __init__(self, main_program, place, lower: bool, deadline: tuple = (None, None)):
        """``deadline``: ``(seconds, setting)`` bounding the ranks' agreement and every wait for a
        pipeline message (seconds None: no agreement, and messages wait
        :data:`~paddle_hybrid.config.DEFAULT_TIMEOUT`)."""
        opt = main_program._pipeline_opt
        self.main = main_program
        self.section = opt["section_program"]
        self.stage = int(opt["pipeline_stage"])
        self.num_stages = int(opt["num_pipeline_stages"])
        self.schedule = opt["schedule_mode"]
        self.num_microbatches = int(opt["num_microbatches"])
        self.micro_batch_size = opt.get("ph_micro_batch_size")
        self.place = place
        self.lower = lower
        self.message_timeout = deadline[0] if deadline[0] is not None else DEFAULT_TIMEOUT
        self._executors: dict = {}  # (scope, fetch names) -> (executor, sub-programs, computed, persistable)
        self._check_pure_pipeline()
        if deadline[0] is not None:
            self._agree(*deadline)

    def _check_pure_pipeline(self) -> None:
        import paddle.distributed as dist

        world = dist.get_world_size()
        if world > 1 and world != self.num_stages:
            raise NotImplementedError(
                f"paddle_hybrid.static.static_pipeline: {world} ranks for {self.num_stages} pipeline stages; only pure "
                "pipeline parallel (one rank per stage, no data parallel) is run by the plugin.")

    def describe(self) -> dict:
        """What every stage must run with alike, under the names of fleet's strategy."""
        return {"pipeline_configs.accumulate_steps": self.num_microbatches,
                "pipeline_configs.micro_batch_size": self.micro_batch_size,
                "pipeline_configs.schedule_mode": self.schedule, "pipeline stages": self.num_stages}

    def _agree(self, seconds: float, setting: str) -> None:
        """Before the first step: every rank publishes :meth:`describe` in the job's store; a
        difference stops every rank, naming the field and each rank's value.  Without it a
        mismatch (``accumulate_steps`` 4 on one stage, 2 on the next) waits in a send or recv
        until the deadline and ends in a timeout that does not name the cause."""
        import paddle.distributed as dist

        from ...common.exchange import AgreementError, differences, exchange

        if dist.get_world_size() < 2:
            return
        by_rank = exchange(self.describe(), topic="static pipeline agreement",
                           ranks=list(range(dist.get_world_size())), rank=dist.get_rank(), timeout=seconds,
                           setting=setting)
        found = differences(by_rank)
        if found:
            raise AgreementError(
                "paddle_hybrid: the stages of the static pipeline disagree before the first step: " + "; ".join(found)
                + ". Every rank must build its program with the same fleet strategy (pipeline_configs).")

    # -- building ---------------------------------------------------------------------------
    def _classify_fetches(self, names):
        """``([(name, owner stage)], [persistable name])``: the same first list on every rank, since
        it is read from the unsplit program every rank holds."""
        block = self.section.global_block()
        computed, persist = [], []
        for n in names:
            if block.has_var(n) and block.var(n).persistable:
                persist.append(n)
                continue
            owner = _stage_of(self.main, n)
            if owner is None:
                raise ValueError(
                    f"paddle_hybrid.static.static_pipeline: cannot fetch {n!r}: it is no persistable variable of stage "
                    f"{self.stage}'s section program and no op of the program computes it on a stage.")
            if owner == self.stage and not any(n in op.output_arg_names and phase_of(op) == FORWARD
                                               for op in block.ops):
                raise ValueError(f"paddle_hybrid.static.static_pipeline: cannot fetch {n!r}: only forward outputs (stacked "
                                 "per micro-batch) and persistable variables can be fetched.")
            computed.append((n, owner))
        return computed, persist

    def _fetch_shape(self, var) -> list:
        shape = list(var.shape)
        if any(d < 0 for d in shape):
            if self.micro_batch_size is None:
                raise ValueError(f"paddle_hybrid.static.static_pipeline: fetched {var.name!r} has an unknown dimension.")
            shape = [self.micro_batch_size if d < 0 else d for d in shape]
        return shape

    def _feeds_of(self, feed) -> dict:
        """``{name: array [accumulate_steps, micro-batch, ...]}`` of the fed variables this stage's
        forward reads; every rank may be given the whole feed dict (what a stage does not read is
        ignored)."""
        block = self.section.global_block()
        forward_ops = [op for op in block.ops if phase_of(op) == FORWARD]
        out = {}
        for name, value in feed.items():
            if not any(name in op.input_arg_names for op in forward_ops):
                continue
            if any(name in op.output_arg_names for op in block.ops):
                raise ValueError(f"paddle_hybrid.static.static_pipeline: {name!r} is fed but the program computes it "
                                 "(a DataLoader's read op?); feed either through the loader or the feed dict.")
            array = np.asarray(value, dtype=_np_dtype(block.var(name).dtype))
            n = self.num_microbatches
            if array.ndim == 0 or array.shape[0] % n:
                raise ValueError(f"paddle_hybrid.static.static_pipeline: fed {name!r} has shape {array.shape}; its first "
                                 f"dimension must be accumulate_steps ({n}) x micro_batch_size.")
            out[name] = array.reshape((n, array.shape[0] // n) + array.shape[1:])
        return out

    def _add_feed_ops(self, forward, feeds) -> None:
        """Forward sub-program, first: ``var = buffer[counter]`` for each fed var."""
        block = forward.global_block()
        role = {"op_role": int(OpRole.Forward)}
        block.create_var(name=_COUNTER, shape=[1], dtype="int64", persistable=True)
        for k, (n, array) in enumerate(sorted(feeds.items())):
            var = block.var(n)
            buf = block.create_var(name=n + _FEED_SUFFIX, shape=list(array.shape), dtype=var.dtype,
                                   persistable=True)
            row = block.create_var(name=n + _FEED_SUFFIX + "@ROW", dtype=var.dtype)
            xshape = block.create_var(name=n + _FEED_SUFFIX + "@XSHAPE", dtype=var.dtype)
            block._insert_op(2 * k, type="gather", inputs={"X": [buf], "Index": [_COUNTER]}, outputs={"Out": [row]},
                             attrs=dict(role, axis=0))
            block._insert_op(2 * k + 1, type="reshape2", inputs={"X": [row]}, outputs={"Out": [var], "XShape": [xshape]},
                             attrs=dict(role, shape=list(array.shape[1:])))

    def _add_fetch_ops(self, forward, names) -> None:
        """Forward sub-program: ``buffer[counter] = var`` for each fetched var, then ``counter += 1``."""
        block = forward.global_block()
        role = {"op_role": int(OpRole.Forward)}
        counter = block.create_var(name=_COUNTER, shape=[1], dtype="int64", persistable=True)
        for n in names:
            var = block.var(n)
            buf = block.create_var(name=n + _FETCH_SUFFIX, shape=[self.num_microbatches] + self._fetch_shape(var),
                                   dtype=var.dtype, persistable=True)
            row = block.create_var(name=n + _FETCH_SUFFIX + "@ROW", dtype=var.dtype)
            block.append_op(type="stack", inputs={"X": [var]}, outputs={"Y": [row]}, attrs=dict(role, axis=0))
            block.append_op(type="scatter", inputs={"X": [buf], "Ids": [counter], "Updates": [row]},
                            outputs={"Out": [buf]}, attrs=dict(role, overwrite=True))
        block.append_op(type="increment", inputs={"X": [counter]}, outputs={"Out": [counter]},
                        attrs=dict(role, step=1.0))

    def _build(self, scope, local, feeds):
        from paddle.distributed.passes.pass_utils import set_skip_gc_vars

        program = lower_for_gloo(self.section, self.message_timeout) if self.lower else self.section.clone()
        subs = split_by_phase(program)
        self._add_fetch_ops(subs[FORWARD], local)
        with deferred_sync(subs[FORWARD].global_block()):
            self._add_feed_ops(subs[FORWARD], feeds)
        jobs = []
        for job_type, mb in job_order(self.schedule, self.stage, self.num_stages, self.num_microbatches):
            job = core.Job(job_type)
            job.set_micro_batch_id(mb)
            jobs.append(job)
        types = list(subs)
        type_to_program = set_skip_gc_vars(self.num_microbatches, types, [subs[t] for t in types], jobs)
        plan = core.Plan(jobs, {t: p.desc for t, p in type_to_program.items()})
        core_place = core.Place()
        core_place.set_place(self.place)
        return core.StandaloneExecutor(core_place, plan, scope), subs

    # -- running ----------------------------------------------------------------------------
    def run(self, scope, feed=None, fetch_names=()):
        """One step; returns the fetched values in ``fetch_names`` order."""
        self._scope = scope
        feeds = self._feeds_of(feed or {})
        key = (id(scope), tuple(fetch_names), tuple(sorted((n, a.shape) for n, a in feeds.items())))
        if key not in self._executors:
            computed, persist = self._classify_fetches(fetch_names)
            local = [n for n, owner in computed if owner == self.stage]
            with _flags(EXECUTOR_FLAGS):
                exe, subs = self._build(scope, local, feeds)
            self._executors[key] = (exe, subs, computed, persist)
        exe, subs, computed, persist = self._executors[key]
        self._prepare_step(subs[FORWARD], [n for n, owner in computed if owner == self.stage])
        for n, array in feeds.items():
            self._set(n + _FEED_SUFFIX, array)
        with _flags(EXECUTOR_FLAGS):
            try:
                exe.run([], False)
            except Exception as exc:
                failure = take_failure()  # the p2p error behind the executor's "std::exception"
                if failure is not None:
                    raise failure from exc
                raise
        if self.lower:
            drain_all(self.message_timeout)  # a step ends when its sends arrived: errors surface in the step that caused them
        values = {n: np.array(scope.find_var(n).get_tensor()) for n in persist}
        values.update(self._share_computed(computed))
        return [values[n] for n in fetch_names]

    def _prepare_step(self, forward, local) -> None:
        self._set(_COUNTER, np.zeros([1], dtype="int64"))
        for n in local:
            var = forward.global_block().var(n + _FETCH_SUFFIX)
            self._set(var.name, np.zeros(var.shape, dtype=_np_dtype(var.dtype)))

    def _set(self, name, array) -> None:
        self._scope.var(name).get_tensor().set(array, self.place)

    def _share_computed(self, computed) -> dict:
        """Each computed fetch from its owner stage to every rank: one broadcast per fetch, in
        fetch-list order on every rank (the list is the same everywhere)."""
        import paddle.distributed as dist

        out = {}
        for n, owner in computed:
            if owner == self.stage:
                out[n] = np.array(self._scope.find_var(n + _FETCH_SUFFIX).get_tensor())
            if dist.get_world_size() <= 1:
                continue
            var = self.main.global_block().var(n)
            with paddle.base.dygraph.guard():
                t = (paddle.to_tensor(out[n]) if owner == self.stage else
                     paddle.zeros([self.num_microbatches] + self._fetch_shape(var), dtype=var.dtype))
                dist.broadcast(t, src=owner)
                out[n] = t.numpy()
        return out


def _np_dtype(dtype):
    return paddle.base.data_feeder.convert_dtype(dtype)


class _flags:
    """Paddle flags set for a ``with`` block, restored after."""

    def __init__(self, flags):
        self.flags = flags

    def __enter__(self):
        self.saved = paddle.get_flags(list(self.flags))
        paddle.set_flags(self.flags)

    def __exit__(self, *exc):
        paddle.set_flags(self.saved)
