"""Same-host collectives over shared memory: ``all_reduce``, ``reduce``, ``broadcast`` and
``all_gather`` of a gloo group whose ranks all run on this machine.

Why: gloo on CPU moves every message through a TCP pair on loopback, handed from gloo's loop thread
to the caller; in a VM each hand-off is a wake-up of another thread.  A small all_reduce costs
0.30 ms back to back and about 1.2 ms inside training here, and tensor parallelism makes ~50 of
them a step: PaddleFormers' TP2 spent 61 ms of a 66-87 ms step in collectives.  Through shared
memory the same all_reduce is a copy in, a counter, a wait and a sum (:file:`custom_ops/local_ring.cc`).

What: Paddle's Python collectives (``paddle.distributed.all_reduce``, ``reduce``, ``broadcast``,
``all_gather`` and the ``stream`` variants, which fleet's TP/SP layers, the plugin's CPU paths,
data parallelism and sharding call) take this path for a gloo group when

* the job runs on one node (``PADDLE_NNODES`` 1, or as many local ranks as ranks in all),
* this rank is a member of a group of 2..64 ranks,
* the tensor is a dense, contiguous CPU tensor (a DistTensor is refused by :mod:`.errors`), and
* for ``all_reduce`` and ``reduce``: SUM, MAX, MIN or PROD of float32/64, int32/64, uint8 or int8
  (``AVG``, bool, half precision and the rest go to gloo, decided by dtype and op only, so every
  rank of a correct program decides alike).

Anything else goes to gloo unchanged.  Each rank reduces the ranks' parts in rank order: the ranks
hold bitwise the same result; for two ranks it is bitwise gloo's (a + b); for more, the sum is in
another order than gloo's ring.  ``reduce`` leaves the other ranks' tensors as they were (gloo
leaves its scratch there).  A call is synchronous and returns a finished task.

Waits: a short spin when this node's ranks do not outnumber its cores and those are otherwise idle
(then a partner arriving within ~0.2 ms costs no sleep), else straight to a futex; every wait obeys the group's deadline
(``PADDLE_HYBRID_TIMEOUT``) and raises :class:`~.errors.GlooTimeoutError` naming the rank that did
not arrive, or :class:`~.errors.GlooPeerLostError` at once when that rank's process is gone (the
launcher's root-cause words).  The segment is set up at a group's first such call (its name
travels through the job's store) and unlinked as soon as every rank has mapped it: nothing is left
in ``/dev/shm`` even if the job dies.  Its memory is reserved when it is made (2 x ranks x 256 KiB a
group): where ``/dev/shm`` is too small (a container's default 64 MiB), the group stays on gloo
with a warning, on every rank alike, instead of a crash at the first write.

Switch: ``PluginConfig.local_ring`` (``PADDLE_HYBRID_LOCAL_RING``, default on), part of the ``cpu``
component (CPU builds only).
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
import uuid

from ..common import exchange
from ..common.tensor_bytes import nbytes
from ..registry.device import is_gloo

__all__ = ["apply", "calls", "eligible_job", "SLOT_BYTES"]

SLOT_BYTES = 1 << 18  # per rank and parity; larger messages go in chunks of this size
_SPIN_SECONDS = 2e-4
_DTYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3, "uint8": 4, "int8": 5}

# (group id, ranks, id of its process group) -> _Ring, or None: the group does not take the path.
# The process group is part of the key (and kept alive by the entry): a group destroyed and made
# again under the same id is another group.
_rings: dict = {}
_lock = threading.Lock()
_calls = {"all_reduce": 0, "reduce": 0, "broadcast": 0, "all_gather": 0}


def calls() -> dict:
    """How many collectives of each kind took the shared-memory path in this process."""
    return dict(_calls)


def eligible_job() -> bool:
    """The job's ranks all run on this node."""
    env = os.environ
    if env.get("PADDLE_NNODES", "").strip() == "1":
        return True
    local, world = env.get("PADDLE_LOCAL_SIZE"), env.get("PADDLE_GLOBAL_SIZE", env.get("PADDLE_TRAINERS_NUM"))
    return bool(local) and local == world


@functools.lru_cache(maxsize=None)
def library():
    """The ops library with the C signatures of the shared-memory paths (``ph_lr_*`` collectives,
    ``ph_lp_*`` point to point, :file:`custom_ops/local_ring.cc`)."""
    from .. import ops

    lib = ctypes.CDLL(ops.library_path(), use_errno=True)
    lib.ph_lr_open.restype = ctypes.c_void_p
    lib.ph_lr_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
    lib.ph_lr_unlink.argtypes = [ctypes.c_char_p]
    lib.ph_lr_close.argtypes = [ctypes.c_void_p]
    common = [ctypes.c_double, ctypes.c_double, ctypes.POINTER(ctypes.c_int)]
    lib.ph_lr_all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int,
                                     *common]
    lib.ph_lr_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, *common]
    lib.ph_lr_broadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, *common]
    lib.ph_lr_all_gather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, *common]
    lib.ph_lp_open.restype = ctypes.c_void_p
    lib.ph_lp_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
    lib.ph_lp_close.argtypes = [ctypes.c_void_p]
    lib.ph_lp_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_double, ctypes.c_double]
    lib.ph_lp_recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_double, ctypes.c_double,
                               ctypes.POINTER(ctypes.c_uint64)]
    return lib


def _timed_out(operation, ranks, waited, seconds, setting, raw):
    from . import errors

    return errors.GlooTimeoutError(errors._message(operation, ranks, waited, "exact", seconds, setting, 0, raw),
                                   operation=operation, group_ranks=ranks, waited_for=waited, seconds=seconds,
                                   setting=setting)


class _Ring:
    """This rank's end of one group's shared-memory segment; its deadline is the group's
    (``seconds``, and ``setting``, the name of what set it)."""

    def __init__(self, handle, ranks: list, seconds: float, setting: str, spin: float):
        self.library, self.handle, self.ranks, self.spin = library(), handle, ranks, spin
        self.timeout, self.setting = seconds, setting

    def run(self, operation: str, function, *args) -> "_Done":
        """Phase: one C operation (``function(handle, *args, deadline, spin, &missing)``) on this
        ring; a failure raised as gloo's path would raise it."""
        missing, started = ctypes.c_int(-1), time.monotonic()
        status = function(self.handle, *args, self.timeout, self.spin, ctypes.byref(missing))
        self.check(operation, status, missing, started)
        _calls[operation] += 1
        return _Done()

    def check(self, operation: str, status: int, missing, started: float) -> None:
        """Phase: turn a C status into the errors gloo's own path would raise (:mod:`.errors`)."""
        if status != 0:
            who = self.ranks[missing.value] if 0 <= missing.value < len(self.ranks) else None
            raise_failure(operation, status, self.ranks, who, time.monotonic() - started, self.timeout, self.setting)


def raise_failure(operation: str, status: int, ranks: list, who, elapsed: float, timeout: float, setting: str):
    """A C status of the shared-memory paths (-1 deadline, -2 the process of rank ``who`` gone) as
    the error gloo's own path would raise (:mod:`.errors`)."""
    from . import errors

    if status == -2:
        raise errors.GlooPeerLostError(
            errors._lost_message(operation, ranks, [who], elapsed, timeout, setting,
                                 f"shared memory: the process of rank {who} is gone"),
            operation=operation, group_ranks=ranks, lost=[who], seconds=elapsed, deadline=timeout)
    if status == -1:
        raise _timed_out(operation, ranks, [who], timeout, setting, f"TIMEOUT (shared memory): rank {who} did not arrive")
    raise RuntimeError(f"paddle_hybrid.local_ring: {operation} failed with status {status}.")


def spin_seconds(local_ranks: int) -> float:
    """How long a wait may spin before it sleeps: 0.2 ms when this node's ranks fit its cores and
    the cores are otherwise idle (load average below the core count when the ring is made), else 0:
    a spinning rank would take the core a peer or another job needs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] >= cores
    except OSError:
        busy = True
    return _SPIN_SECONDS if local_ranks <= cores and not busy else 0.0


def open_segment(ranks: list, me: int, topic: str, make, attach, close, what: str, size: int, timeout: float,
                 setting: str):
    """Phases: the first of ``ranks`` (global ranks) makes the segment (``make(name)``: a handle, or
    0 with errno set: too little ``/dev/shm``) and says its name through the job's store
    (:func:`~paddle_hybrid.common.exchange.exchange`); the others map it (``attach(name)``); the
    ranks say whether they could, and the first unlinks the name (the mappings stay).  Any failure
    anywhere: every rank closes what it has and gets None, with a warning naming ``what`` (the
    group it was for) and why (``size``: the bytes it needs)."""
    import warnings

    name, handle, why = None, None, None
    if me == ranks[0]:
        name = f"/ph_lr_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        handle = make(name.encode())
        if not handle:
            why = f"cannot make {size >> 10} KiB of shared memory: {os.strerror(ctypes.get_errno())}"
            name = None
    name = exchange.exchange(name, topic=f"{topic}/name", ranks=ranks, rank=me, timeout=timeout,
                             setting=setting)[ranks[0]]
    if me != ranks[0] and name is not None:
        handle = attach(name.encode())
        if not handle:
            why = f"cannot map {name}: {os.strerror(ctypes.get_errno())}"
    mapped = exchange.exchange(bool(handle), topic=f"{topic}/mapped", ranks=ranks, rank=me, timeout=timeout,
                               setting=setting)
    if me == ranks[0] and name is not None:
        library().ph_lr_unlink(name.encode())
    if all(mapped.values()):
        return handle
    if handle:
        close(handle)
    failed = sorted(r for r, ok in mapped.items() if not ok)
    reason = why or f"ranks {failed} could not make or map its shared memory"
    warnings.warn(f"paddle_hybrid.local_ring: {what} keeps gloo's TCP path: {reason} "
                  "(PADDLE_HYBRID_LOCAL_RING=0 silences this).", RuntimeWarning, stacklevel=3)
    return None


def _open(group, timeout: float, setting: str):
    """The group's ring (its segment made by group rank 0, see :func:`open_segment`), or None."""
    import paddle.distributed as dist

    lib, ranks, n = library(), list(group.ranks), group.nranks
    handle = open_segment(ranks, dist.get_rank(), f"local_ring/{group.id}",
                          lambda name: lib.ph_lr_open(name, 1, n, 0, SLOT_BYTES),
                          lambda name: lib.ph_lr_open(name, 0, n, group.rank, SLOT_BYTES),
                          lib.ph_lr_close, f"gloo group {ranks}", 2 * n * SLOT_BYTES, timeout, setting)
    if handle is None:
        return None
    return _Ring(handle, ranks, timeout, setting, spin_seconds(int(os.environ.get("PADDLE_LOCAL_SIZE", n))))


def _close_all() -> None:
    """At uninstall: unmap every ring of this process (their names are long unlinked)."""
    with _lock:
        for ring, _ in _rings.values():
            if ring is not None:
                ring.library.ph_lr_close(ring.handle)
        _rings.clear()


def set_up(group, config, operation: str, make):
    """Phase: ``make(seconds, setting)`` (a segment's set-up, a rendezvous through the job's store)
    under the group's deadline; a rank that does not come is named as the collective would name it."""
    from . import errors

    seconds, setting = errors._deadline(group.process_group, config)
    seconds = float(config.timeout) if seconds is None else seconds
    try:
        return make(seconds, setting)
    except exchange.ExchangeTimeout as exc:
        raise _timed_out(operation, list(group.ranks), exc.missing, seconds, setting,
                         "TIMEOUT (shared memory set-up)") from exc


def _ring(group, config, operation: str):
    """The group's ring, or None when the group does not take this path.  Made at the group's first
    such collective, a rendezvous of its ranks like the collective itself: a rank that does not
    come is named as the collective would name it."""
    process_group = getattr(group, "process_group", None)
    key = (group.id, tuple(group.ranks), id(process_group))
    with _lock:
        if key in _rings:
            return _rings[key][0]
        ring = None
        if 2 <= group.nranks <= 64 and group.rank >= 0 and is_gloo(group):
            ring = set_up(group, config, operation, lambda seconds, setting: _open(group, seconds, setting))
        _rings[key] = (ring, process_group)
        return ring


def _dense_cpu(tensor) -> bool:
    try:
        return (not tensor.is_dist()) and tensor.place.is_cpu_place() and tensor.is_contiguous()
    except (AttributeError, RuntimeError):
        return False


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).replace("paddle.", "")


class _Done:
    """What a finished gloo task answers."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def synchronize(self):
        return None


@functools.lru_cache(maxsize=None)
def _reduce_codes() -> dict:
    from paddle.distributed import ReduceOp

    return {ReduceOp.SUM: 0, ReduceOp.MAX: 1, ReduceOp.MIN: 2, ReduceOp.PROD: 3}


def _reduce_code(op):
    """Paddle's ReduceOp (SUM 0, MAX 1, MIN 2, PROD 3) as the kernel's, or None (AVG, ...)."""
    return _reduce_codes().get(op)


def _group(group):
    from paddle.distributed.communication.group import _get_global_group

    return _get_global_group() if group is None else group


def _make_all_reduce(original, config):
    @functools.wraps(original)
    def _all_reduce_in_dygraph(tensor, op, group, sync_op, use_calc_stream):
        code, dtype = _reduce_code(op), _DTYPES.get(_dtype_name(tensor))
        if code is not None and dtype is not None and _dense_cpu(tensor):
            ring = _ring(_group(group), config, "all_reduce")
            if ring is not None:
                return ring.run("all_reduce", ring.library.ph_lr_all_reduce, tensor.data_ptr(), tensor._numel(),
                                dtype, code)
        return original(tensor, op, group, sync_op, use_calc_stream)

    return _all_reduce_in_dygraph


def _make_reduce(original, config):
    @functools.wraps(original)
    def _reduce_in_dygraph(tensor, dst_rank_in_group, op, group, sync_op, use_calc_stream):
        code, dtype = _reduce_code(op), _DTYPES.get(_dtype_name(tensor))
        if code is not None and dtype is not None and _dense_cpu(tensor):
            group_ = _group(group)
            ring = _ring(group_, config, "reduce")
            if ring is not None and 0 <= dst_rank_in_group < group_.nranks:
                return ring.run("reduce", ring.library.ph_lr_reduce, tensor.data_ptr(), tensor._numel(), dtype, code,
                                dst_rank_in_group)
        return original(tensor, dst_rank_in_group, op, group, sync_op, use_calc_stream)

    return _reduce_in_dygraph


def _make_broadcast(original, config):
    @functools.wraps(original)
    def _broadcast_in_dygraph(tensor, src_rank_in_group, group, sync_op, use_calc_stream):
        if _dense_cpu(tensor):
            group_ = _group(group)
            ring = _ring(group_, config, "broadcast")
            if ring is not None and 0 <= src_rank_in_group < group_.nranks:
                return ring.run("broadcast", ring.library.ph_lr_broadcast, tensor.data_ptr(), nbytes(tensor),
                                src_rank_in_group)
        return original(tensor, src_rank_in_group, group, sync_op, use_calc_stream)

    return _broadcast_in_dygraph


def _gather(ring, out_ptr, tensor) -> None:
    ring.run("all_gather", ring.library.ph_lr_all_gather, tensor.data_ptr(), out_ptr, nbytes(tensor))


def _make_all_gather_into_tensor(original, config):
    @functools.wraps(original)
    def _all_gather_into_tensor_in_dygraph(out_tensor, in_tensor, group, sync_op, use_calc_stream):
        if _dense_cpu(in_tensor) and _dense_cpu(out_tensor) and out_tensor.dtype == in_tensor.dtype:
            group_ = _group(group)
            ring = _ring(group_, config, "all_gather")
            if ring is not None and out_tensor._numel() == in_tensor._numel() * group_.nranks:
                _gather(ring, out_tensor.data_ptr(), in_tensor)
                return _Done()
        return original(out_tensor, in_tensor, group, sync_op, use_calc_stream)

    return _all_gather_into_tensor_in_dygraph


def _make_all_gather(original, config):
    @functools.wraps(original)
    def _all_gather_in_dygraph(tensor_list, tensor, group, sync_op, use_calc_stream):
        import paddle

        if _dense_cpu(tensor):
            group_ = _group(group)
            ring = _ring(group_, config, "all_gather")
            if ring is not None:
                out = paddle.empty([group_.nranks, *tensor.shape], dtype=tensor.dtype)
                _gather(ring, out.data_ptr(), tensor)
                parts = list(paddle.unbind(out, axis=0))
                if len(tensor_list) == 0:
                    tensor_list.extend(parts)
                else:  # the caller's tensors keep their identity: fill them
                    for target, part in zip(tensor_list, parts):
                        paddle.assign(part, output=target)
                return _Done()
        return original(tensor_list, tensor, group, sync_op, use_calc_stream)

    return _all_gather_in_dygraph


def apply(config, patcher) -> str | None:
    """Phase: route the dygraph collectives of one-node gloo groups through shared memory."""
    if not getattr(config, "local_ring", True) or getattr(config, "fake_world", None) or not eligible_job():
        return None
    import importlib

    where = "paddle.distributed.communication.stream"
    # the modules, not the functions of the same names the package exports
    all_reduce, reduce, broadcast, all_gather = (importlib.import_module(f"{where}.{name}")
                                                 for name in ("all_reduce", "reduce", "broadcast", "all_gather"))
    for module, name, make in ((all_reduce, "_all_reduce_in_dygraph", _make_all_reduce),
                               (reduce, "_reduce_in_dygraph", _make_reduce),
                               (broadcast, "_broadcast_in_dygraph", _make_broadcast),
                               (all_gather, "_all_gather_into_tensor_in_dygraph", _make_all_gather_into_tensor),
                               (all_gather, "_all_gather_in_dygraph", _make_all_gather)):
        original = patcher.require(module, name, f"{where}.{module.__name__.rsplit('.', 1)[-1]}")
        patcher.set(module, name, make(original, config))
    patcher.on_revert(_close_all, "the shared-memory rings of this process")
    return "same-host gloo collectives (all_reduce, reduce, broadcast, all_gather) through shared memory"
