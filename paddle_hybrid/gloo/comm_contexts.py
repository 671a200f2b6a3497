"""Gloo comm contexts for static programs on CPU: made one way, and the right one for each collective.

Two things a static program's collectives need on a CPU build, whichever of fleet, the legacy
``Engine`` or ``dist.to_static`` came first:

* **A comm context per group, made once.** A group's collectives find their context in
  ``phi::distributed::CommContextManager`` under the group's id (``str(ring_id)``); a key can be
  made only once (a second ``create_gloo_comm_context`` raises AlreadyExists).  Fleet's and
  ``init_parallel_env``'s process groups already put theirs there (the world group under "0").
  :func:`ensure` makes a group's context unless the key is taken; a taken key is used when it is
  the same group (the same ranks, in the same order, as ``paddle.distributed`` knows them, or the
  world group under "0"), and refused naming both groups otherwise.  GPU builds do the same
  (``create_nccl_comm_context`` returns early when the key is taken); a CPU build raised.

* **The right context for each collective.** Every instruction of a CPU program is given the
  one shared CPU device context, and Paddle's executor sets its comm context only while it has
  none (``interpreter::SetDeviceCommContext``): the first group used would serve every later
  collective, whatever its ring.  :func:`select_rings` puts a ``ph_use_ring`` op (plugin's C++,
  ``custom_ops/comm_rings.cc``) before every op with a ``ring_id`` attribute; it points the
  shared context at its ring's comm context right before the collective runs (at none, for a
  ring this process has no context for: such a collective then fails instead of running on
  another group).  The op carries a
  ``ring_id`` too, so the executor orders it among the communication ops in program order.
  :func:`apply` does this to the executor's own copy of every PIR program it is about to run on a
  CPU place (``_StandaloneExecutor``), so a user's program is never changed.

* **Pipeline sends and receives.** A PIR pipeline's stages exchange activations with the legacy
  ``send_v2`` / ``recv_v2``, whose CPU kernels only throw.  :func:`select_rings` replaces each by
  ``ph_send_v2`` / ``ph_recv_v2`` (plugin's C++, ``custom_ops/gloo_kernels.cc``, same attributes)
  on its ring's gloo context.  A send is posted to a thread of its ring and the op returns, as a
  GPU's send only enqueues on a stream (1F1B's stages each receive before they send);
  :func:`flush_sends` waits for them, at exit too.  The cross-job events the pipeline pass adds
  order nothing on a CPU place (synchronous ops, jobs run one after another) and the executor
  cannot register them there, so they are dropped from the executor's copy.

Legacy-IR programs (``FLAGS_enable_pir_api=0``) are not rewritten here; their collectives run on
the first ring's context, and :mod:`paddle_hybrid.static.auto_parallel_cpu` refuses a group whose
ranks differ from the first (a 1 x N mesh only).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import threading

from . import fake_contexts, fake_world

__all__ = ["USE_RING_OP", "SEND_OP", "RECV_OP", "CommContextConflict", "address", "apply", "ensure", "flush_sends",
           "has", "made", "select_rings", "selected"]

USE_RING_OP, SEND_OP, RECV_OP = "ph_use_ring", "ph_send_v2", "ph_recv_v2"
# As PIR names them (an in-place custom op's name ends in "_").
_PLUGIN_OPS = {f"custom_op.{name}{inplace}" for name in (USE_RING_OP, SEND_OP, RECV_OP) for inplace in ("", "_")}

_selected_programs = [0]  # how many programs select_rings changed in this process (the tests)


class CommContextConflict(RuntimeError):
    """A group's comm-context key is taken by another group."""


@functools.lru_cache(maxsize=None)
def _library():
    from .. import ops

    library = ctypes.CDLL(ops.library_path())
    library.ph_comm_context_has.argtypes = [ctypes.c_char_p]
    library.ph_comm_context_has.restype = ctypes.c_int
    library.ph_comm_context.argtypes = [ctypes.c_char_p]
    library.ph_comm_context.restype = ctypes.c_void_p
    library.ph_p2p_flush.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return library


def has(key: str) -> bool:
    """Whether the comm-context manager of this process holds ``key``."""
    return bool(_library().ph_comm_context_has(str(key).encode()))


def address(key: str) -> int:
    """Address of the comm context the manager holds under ``key`` (0: none)."""
    return _library().ph_comm_context(str(key).encode()) or 0


made: dict = {}
"""group id -> address of every comm context :func:`ensure` made in this process."""


# -- making contexts -------------------------------------------------------------------------

def ensure(group_id: int, ranks: list, rank: int, world_ranks: list, store_of, timeout: float) -> bool:
    """The gloo comm context of group ``group_id`` (global ``ranks``, this process global
    ``rank``): made on ``store_of()`` (a store for this group alone) unless the key is taken by
    the same group; ``world_ranks`` are the job's ranks (group 0 is the world).  Its operations
    wait ``timeout`` seconds for a peer (gloo's own default is 30 s).  Returns whether a context
    was made.  Raises :class:`CommContextConflict` when the key belongs to another group."""
    from paddle.base import core

    key = str(group_id)
    if has(key):
        _check_same_group(group_id, list(ranks), list(world_ranks))
        return False
    if fake_world.active():  # no peer to meet: a fake context (gloo.fake_contexts) of the same rank and size
        fake_contexts.make_fake_context(key, list(ranks).index(rank), len(ranks))
    else:
        core.CommContextManager.create_gloo_comm_context(store_of(), key, list(ranks).index(rank), len(ranks))
        fake_contexts.name_in_log(key)  # a real run's probe logs its collectives by this key
    made[group_id] = address(key)
    if not fake_world.active():  # a fake context (gloo.fake_contexts) waits on nothing and is no gloo context
        _set_deadline(made[group_id], timeout)
    return True


def _set_deadline(comm: int, timeout: float) -> None:
    """The context's gloo operations wait ``timeout``; where this Paddle does not allow it, gloo's
    30 s stays and one warning says so."""
    import warnings

    from . import context_timeout

    try:
        context_timeout.set_comm_context_timeout_ms(comm, max(1, int(timeout * 1000)))
    except context_timeout.GlooTimeoutUnavailable as exc:
        warnings.warn(f"paddle_hybrid: a static program's gloo contexts keep gloo's 30 s timeout ({exc}).",
                      RuntimeWarning, stacklevel=3)


def _check_same_group(group_id: int, ranks: list, world_ranks: list) -> None:
    """The key ``str(group_id)`` is taken: fine when ``paddle.distributed`` made it for the same
    ranks (its group ``group_id``, or the world for 0)."""
    from paddle.distributed import collective

    known = collective._get_group_map().get(group_id)
    theirs = list(known.ranks) if known is not None else (list(world_ranks) if group_id == 0 else None)
    if theirs is not None and sorted(theirs) == sorted(ranks) and (group_id == 0 or theirs == ranks):
        return
    raise CommContextConflict(
        f"paddle_hybrid: comm context {group_id} already exists for "
        f"{'ranks ' + str(theirs) if theirs is not None else 'a group paddle.distributed does not list'}; "
        f"a static program's group {group_id} has ranks {ranks}. Two groups cannot share one id: create the "
        "fleet / paddle.distributed groups before building the static program (its group ids start after "
        "theirs), or in the same order on every rank.")


# -- selecting contexts ----------------------------------------------------------------------

def _collectives(block) -> list:
    """Every op of ``block`` and its sub-blocks that names a ring (the plugin's own ops aside)."""
    found = []
    for op in block.ops:
        for region_block in _sub_blocks(op):
            found.extend(_collectives(region_block))
        if op.name() not in _PLUGIN_OPS and op.has_attr("ring_id"):
            found.append(op)
    return found


def _sub_blocks(op) -> list:
    """The blocks of ``op``'s regions (control flow)."""
    return list(op.blocks())


def select_rings(program) -> int:
    """Make the collectives of the PIR ``program`` (in place) run on their own ring's comm context:
    each ``send_v2`` / ``recv_v2`` becomes a ``ph_send_v2`` / ``ph_recv_v2`` (which name their ring
    themselves), and a ``ph_use_ring`` goes before every other op that names a ring; the pipeline
    pass's cross-job events are dropped (see ``_CROSS_JOB_EVENT_ATTRS``).  Returns how many ops were
    changed or preceded; a program already done is left as it is."""
    import paddle
    from paddle import pir

    _drop_cross_job_events(program.global_block())
    ops = _collectives(program.global_block())
    if not ops or _already_selected(program):
        return 0
    with paddle.pir_utils.IrGuard(), paddle.static.program_guard(program):
        for op in ops:
            pir.set_insertion_point(op)
            rewrite = _P2P_REWRITES.get(op.name())
            if rewrite is not None:
                rewrite(op)
                op.erase()
            else:
                paddle._C_ops._run_custom_op(USE_RING_OP, _anchor(), int(op.attrs()["ring_id"]))
        pir.reset_insertion_point_to_end()
    _selected_programs[0] += 1
    return len(ops)


def _anchor(dtype=None):
    """A one-element CPU tensor for an op that needs an input (and, for ``ph_recv_v2``, its dtype)."""
    import paddle

    return paddle._C_ops.full([1], 0, dtype or paddle.int32, paddle.CPUPlace())


def _first(result):
    return result[0] if isinstance(result, (list, tuple)) else result


def _send_v2(op) -> None:
    import paddle

    attrs = op.attrs()
    paddle._C_ops._run_custom_op(SEND_OP, op.operand_source(0), int(attrs["ring_id"]), int(attrs["peer"]),
                                 bool(attrs["dynamic_shape"]))


def _recv_v2(op) -> None:
    import paddle

    attrs = op.attrs()
    like = _anchor(attrs["dtype"])
    out = _first(paddle._C_ops._run_custom_op(RECV_OP, like, int(attrs["ring_id"]), int(attrs["peer"]),
                                              [int(d) for d in attrs["out_shape"]], bool(attrs["dynamic_shape"])))
    op.result(0).replace_all_uses_with(out)


_P2P_REWRITES = {"pd_op.send_v2": _send_v2, "pd_op.recv_v2": _recv_v2}

# The events a pipeline pass puts on ops for the executor, across the jobs of a plan (a recv of
# one job recorded, a matmul of a later job waits).  Paddle's executor registers such an event
# only where it analyses streams, which a CPU place never has: a CPU plan with them stops ("don't
# have the event ...").  On CPU every op is synchronous and the jobs of a plan run one after
# another, so they order nothing there and are dropped from the executor's copy.
_CROSS_JOB_EVENT_ATTRS = ("events_to_wait", "force_record_event", "event_to_record")


def _drop_cross_job_events(block) -> int:
    dropped = 0
    for op in block.ops:
        for region_block in _sub_blocks(op):
            dropped += _drop_cross_job_events(region_block)
        for name in _CROSS_JOB_EVENT_ATTRS:
            if op.has_attr(name):
                op.erase_attr(name)
                dropped += 1
    return dropped


def _already_selected(program) -> bool:
    return any(op.name() in _PLUGIN_OPS for op in program.global_block().ops)


def flush_sends() -> None:
    """Wait until every send a ``ph_send_v2`` posted is done (each waits on its own thread, as a
    GPU's stream would); raises the first error of one.  Registered at exit: a last stage's
    final gradient send must reach its peer before the process ends."""
    library = _library()
    error = ctypes.create_string_buffer(4096)
    if library.ph_p2p_flush(error, len(error)) != 0:
        raise RuntimeError(error.value.decode(errors="replace"))


def selected() -> int:
    """How many programs :func:`select_rings` changed in this process."""
    return _selected_programs[0]


_building_pir = threading.local()  # .active: inside the executor cache's PIR path


def _make_get_pir_program_and_executor(original):
    @functools.wraps(original)
    def _get_pir_program_and_executor(self, cached_data):
        _building_pir.active = True
        try:
            return original(self, cached_data)
        finally:
            _building_pir.active = False

    return _get_pir_program_and_executor


def _make_create_new_executor(original, wanted):
    @functools.wraps(original)
    def _create_new_executor(self):
        # Only the PIR path's plans hold PIR programs (asking a legacy plan for one breaks it).
        if getattr(_building_pir, "active", False) and wanted(self._place):
            for job_type in self._plan.job_types():
                select_rings(self._plan.ir_program(job_type))
        return original(self)

    return _create_new_executor


def apply(config, patcher, when) -> None:
    """Rewrite the executor's copy of every PIR program it runs on a CPU place while ``when()``
    is true (a CPU build)."""
    from paddle.base import executor

    cache, standalone = executor._ExecutorCache, executor._StandaloneExecutor
    patcher.check_params(standalone._create_new_executor, ["self"], "_StandaloneExecutor._create_new_executor")
    patcher.check_params(cache._get_pir_program_and_executor, ["self", "cached_data"],
                         "_ExecutorCache._get_pir_program_and_executor")

    def wanted(place) -> bool:
        return when() and place.is_cpu_place()

    atexit.register(flush_sends)
    patcher.on_revert(lambda: atexit.unregister(flush_sends), "atexit: flush the ph_send_v2 sends")
    patcher.set(cache, "_get_pir_program_and_executor",
                _make_get_pir_program_and_executor(cache._get_pir_program_and_executor))
    patcher.set(standalone, "_create_new_executor", _make_create_new_executor(standalone._create_new_executor, wanted))
