"""Legacy auto-parallel ``Engine.fit`` (static, ``FLAGS_enable_pir_api=0``) on CPU over gloo.

Stock Paddle 3.3.1 stops four times on a CPU build; each change acts only there:

=================================================  ============================================
Paddle                                             change
=================================================  ============================================
``cluster``'s ``paddle.device.cuda.               raises on CPU: the cluster module's
get_device_properties``                            ``paddle`` answers with a CPU description
                                                   (name, memory) (a device answer)
``ProcessGroup.instantiate``                       asserts "No CUDA device found": a gloo comm
                                                   context per group, on a store of the group's
                                                   own (:mod:`paddle_hybrid.gloo.rings`)
``helper``'s ``paddle.device.synchronize``        refuses CPU: the helper module's
                                                   ``paddle`` answers that there is nothing to
                                                   synchronize (a device answer)
``Engine._parallel``                               the Resharder's ``c_concat`` has no CPU kernel:
                                                   lowered to ``all_gather`` + ``split`` +
                                                   ``concat`` (same values)
=================================================  ============================================

Limit: a legacy collective op on CPU gets its comm context through the one shared CPU device
context, set by the first ring used (``interpreter::SetDeviceCommContext``).  Every group must
therefore hold the same ranks in the same order (a 1 x N mesh); ``instantiate`` refuses any other
group with that reason instead of letting its collectives run on the wrong ranks.

When: ``PluginConfig.auto_parallel_cpu`` (``PADDLE_HYBRID_AUTO_PARALLEL_CPU``), an auto/on/off
field of :mod:`paddle_hybrid.registry.gate`.  CPU-only code: on an accelerator build every
replacement hands its call to Paddle's original and every device answer is Paddle's.
"""
from __future__ import annotations

import functools

from ...registry.component import Component
from ...registry.device import accelerator_build

__all__ = ["COMPONENT", "apply", "lower_c_concat"]


def _cpu_build() -> bool:
    return accelerator_build() is None


class _CpuProperties:
    """What the cluster description reads of a device: a name and its memory."""

    name = "CPU"
    total_memory = 16 * 1000 ** 3


def _cpu_device_properties(*_args, **_kwargs):
    return _CpuProperties()


def _nothing_to_synchronize(*_args, **_kwargs):
    return None  # CPU ops are synchronous


# -- process groups -------------------------------------------------------------------------

_first_group_ranks: list = []  # ranks of the first group given a comm context in this process


def _make_instantiate(original, timeout_of):
    @functools.wraps(original)
    def instantiate(self):
        from paddle.distributed.auto_parallel.static import process_group

        from ...gloo import comm_contexts, rings

        if not _cpu_build() or self._is_instantiate:
            return original(self)
        genv = process_group._get_global_env()
        if self.nranks >= 2 and genv.rank in self.ranks:
            if not _pir_programs():
                _check_same_ranks(self)
            info = rings.RingInfo(self.id, self.local_rank(genv.rank), [genv.trainer_endpoints[i] for i in self.ranks])
            comm_contexts.ensure(self.id, list(self.ranks), genv.rank, list(range(genv.world_size)),
                                 lambda: rings.ring_store(info, _store_name(self), timeout_of()), timeout_of())
        self._is_instantiate = True  # the store rendezvous synchronised the members

    return instantiate


def _store_name(group) -> str:
    """The store prefix of a group's rendezvous.  Its ranks are part of it: the PIR reshard numbers
    groups per process, so one id names [0, 1] on ranks 0 and 1 and [2, 3] on ranks 2 and 3."""
    return f"auto_parallel/{group.id}/{'-'.join(map(str, group.ranks))}"


def _pir_programs() -> bool:
    """Whether static programs are PIR programs here (whose collectives each get their own ring's
    context: :func:`paddle_hybrid.gloo.comm_contexts.select_rings`)."""
    from paddle.base.framework import get_flags

    return bool(get_flags("FLAGS_enable_pir_api")["FLAGS_enable_pir_api"])


def _check_same_ranks(group) -> None:
    ranks = list(group.ranks)
    if not _first_group_ranks:
        _first_group_ranks.extend(ranks)
    elif ranks != _first_group_ranks:
        raise NotImplementedError(
            f"paddle_hybrid.static.auto_parallel_cpu: process group {group.id} has ranks {ranks}, an earlier group "
            f"{_first_group_ranks}. On CPU every collective op of a legacy-IR program runs on the first group's gloo "
            "context (Paddle sets it once on the shared CPU device context), so only meshes whose groups all "
            "hold the same ranks (1 x N) run correctly there; PIR programs (FLAGS_enable_pir_api=1, the default) "
            "run any mesh.")


def _world_barrier(*_args, **_kwargs):
    """``_legacy_C_ops.barrier(x, x, 'ring_id', 0)`` of the helper: the world group's barrier (the
    CPU kernel of the legacy op finds no comm context on the shared CPU device context)."""
    import paddle.distributed as dist

    dist.barrier()


# -- c_concat -------------------------------------------------------------------------------

def lower_c_concat(program) -> int:
    """Replace every ``c_concat`` of ``program``'s global block (concatenate the ring's shards
    along the last axis) by ``all_gather`` (shards stacked along axis 0), ``split`` into the
    shards and ``concat`` along the last axis.  Returns how many were replaced."""
    from ...common.program_edit import deferred_sync

    block = program.global_block()
    count, idx = 0, 0
    with deferred_sync(block):
        while idx < len(block.ops):
            op = block.ops[idx]
            if op.type != "c_concat":
                idx += 1
                continue
            _lower_one(block, idx, op)
            count += 1
            idx += 3
    return count


def _lower_one(block, idx, op) -> None:
    x, out = op.input("X")[0], op.output("Out")[0]
    nranks, ring_id = op.attr("nranks"), op.attr("ring_id")  # read before the op is removed
    role = {"op_role": op.attr("op_role")}
    namescope = op.attr("op_namescope") if op.has_attr("op_namescope") else None
    dtype = block.var(x).dtype
    gathered = block.create_var(name=x + "@PH_GATHERED", dtype=dtype)
    pieces = [block.create_var(name=f"{x}@PH_SHARD{i}", dtype=dtype) for i in range(nranks)]
    block._remove_op(idx)
    new_ops = [
        block._insert_op(idx, type="all_gather", inputs={"x": [x]}, outputs={"out": [gathered]},
                         attrs=dict(role, ring_id=ring_id, nranks=nranks)),
        block._insert_op(idx + 1, type="split", inputs={"X": [gathered]}, outputs={"Out": pieces},
                         attrs=dict(role, num=nranks, axis=0)),
        block._insert_op(idx + 2, type="concat", inputs={"X": pieces}, outputs={"Out": [out]},
                         attrs=dict(role, axis=-1)),
    ]
    if namescope is not None:  # still marked as reshard's (inserting sets the current name scope)
        for new_op in new_ops:
            new_op._set_attr("op_namescope", namescope)


def _make_parallel(original):
    @functools.wraps(original)
    def _parallel(self, mode, all_ranks=False):
        result = original(self, mode, all_ranks)
        if _cpu_build():
            for program in self._dist_contexts[mode].dist_main_programs.values():
                lower_c_concat(program)
        return result

    return _parallel


# -- install --------------------------------------------------------------------------------

def apply(config, patcher) -> None:
    """Phases: check every target, then the device answers and the patches."""
    from paddle.distributed.auto_parallel.static import cluster, engine, helper, process_group

    from ...gloo import comm_contexts

    patcher.check_params(process_group.ProcessGroup.instantiate, ["self"], "ProcessGroup.instantiate")
    patcher.check_params(engine.Engine._parallel, ["self", "mode", "all_ranks"], "Engine._parallel")
    timeout = config.seconds("static_pipeline_timeout")
    patcher.answer(cluster, "paddle", {"device.cuda.get_device_properties": _cpu_device_properties},
                   when=_cpu_build, why="the cluster description of a CPU machine")
    patcher.answer(helper, "paddle", {"device.synchronize": _nothing_to_synchronize,
                                      "_legacy_C_ops.barrier": _world_barrier},
                   when=_cpu_build, why="ProgramHelper.init's synchronize and world barrier")
    comm_contexts.apply(config, patcher, when=_cpu_build)
    patcher.set(process_group.ProcessGroup, "instantiate",
                _make_instantiate(process_group.ProcessGroup.instantiate, lambda: timeout))
    patcher.set(engine.Engine, "_parallel", _make_parallel(engine.Engine._parallel))


COMPONENT = Component("auto_parallel_cpu", ("3.2.", "3.3."), "auto_parallel_cpu", apply)
