"""Same-host point to point over shared memory: ``send`` and ``recv`` (and ``isend``/``irecv``,
which fleet's pipeline p2p and the plugin's pair groups call) of a gloo group whose ranks all run
on this machine.

Why: gloo's send on CPU is a rendezvous over a TCP pair: it returns only once the receiver has
posted its receive and the bytes went through gloo's loop threads.  In PaddleFormers' PP2 Trainer
on 2 cores a 16 KiB activation took 1.4 ms to send and the last stage waited 4 ms a step in
receives; the collectives of the same run already go through shared memory (:mod:`.local_ring`).

What: Paddle's dygraph ``send``/``recv`` (the functions of ``paddle.distributed.communication.
stream`` that ``paddle.distributed.send``/``isend``/``recv``/``irecv`` call) take this path for a
gloo group when the job runs on one node (:func:`.local_ring.eligible_job`) and the tensor is a
dense CPU tensor: any dtype (bytes are moved, not values) and any layout (a non-contiguous tensor
is sent from a contiguous copy and received through one).  Anything else goes to gloo, decided
by what both ends know alike (the group, the place, dense or not).

Semantics, against gloo's:

* Each pair of ranks of a group has one segment, made at their first message (2 lanes of
  ``LANE_BYTES``, one per direction; set up like the rings, :func:`.local_ring.open_segment`).
* A send returns once its bytes are in the lane (a message larger than the lane streams through
  it as the receiver reads).  gloo's send waits for the receive to be posted, so every program
  that completes on gloo completes here; one that relied on a send waiting (two ranks sending to
  each other first) now completes where gloo timed out.
* Messages between two ranks arrive in the order they were sent, as gloo matches them too (its
  tags count each rank's calls in order).
* A receive whose tensor holds another number of bytes than the message is refused, naming both
  (:class:`LocalP2PLengthError`); the pair is then out of step and refuses every later message.
* Every wait obeys the group's deadline and names the peer (:class:`~.errors.GlooTimeoutError`),
  or :class:`~.errors.GlooPeerLostError` at once when the peer's process is gone.  A call returns a
  finished task, as gloo's does.

``batch_isend_irecv``: its ops run here as they are posted; the process group's coalescing around
them gets only its own tasks (:func:`_make_coalescing_manager`).

Mixing: a message one end sends through this path and the other receives through the process
group's own ``send``/``recv`` (not through ``paddle.distributed``) would not meet; Paddle's
dygraph p2p goes through ``paddle.distributed`` on both ends.

Switch: ``PluginConfig.local_p2p`` (``PADDLE_HYBRID_LOCAL_P2P``, default on), part of the ``cpu``
component (CPU builds only).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import time

from . import local_ring
from ..common.tensor_bytes import nbytes
from ..registry.device import is_gloo

__all__ = ["apply", "calls", "LANE_BYTES", "LocalP2PLengthError"]

LANE_BYTES = 1 << 20  # per direction; a longer message streams through the lane

# (group id, group ranks, id of its process group, peer's group rank) -> _Pair, or None: the pair
# keeps gloo's path.  The process group is kept alive by the entry (see local_ring._rings).
_pairs: dict = {}
_lock = threading.Lock()
_calls = {"send": 0, "recv": 0}


class LocalP2PLengthError(RuntimeError):
    """A receive's tensor holds another number of bytes than the message sent to it."""


def calls() -> dict:
    """How many sends and receives took the shared-memory path in this process."""
    return dict(_calls)


class _Pair:
    """This rank's end of the segment it shares with one peer of a group."""

    def __init__(self, handle, group_ranks: list, peer: int, seconds: float, setting: str, spin: float):
        self.library, self.handle, self.spin = local_ring.library(), handle, spin
        self.group_ranks, self.peer, self.timeout, self.setting = group_ranks, peer, seconds, setting
        self.broken = None  # why the pair is out of step, once it is

    def send(self, pointer: int, size: int) -> None:
        self._refuse_if_broken("send")
        started = time.monotonic()
        status = self.library.ph_lp_send(self.handle, pointer, size, self.timeout, self.spin)
        self._check("send", status, started)
        _calls["send"] += 1

    def recv(self, pointer: int, size: int) -> None:
        self._refuse_if_broken("recv")
        started, sent = time.monotonic(), ctypes.c_uint64(0)
        status = self.library.ph_lp_recv(self.handle, pointer, size, self.timeout, self.spin, ctypes.byref(sent))
        if status == -4:
            self.broken = (f"rank {self.peer} sent a message of {sent.value} bytes to a receive of {size} bytes "
                           "(the tensors of a send and its receive must have the same shape and dtype)")
            raise LocalP2PLengthError(f"paddle_hybrid: recv on the gloo group of ranks {self.group_ranks}: "
                                      f"{self.broken}.")
        self._check("recv", status, started)
        _calls["recv"] += 1

    def _refuse_if_broken(self, operation: str) -> None:
        if self.broken:
            raise LocalP2PLengthError(f"paddle_hybrid: {operation} with rank {self.peer} on the gloo group of ranks "
                                      f"{self.group_ranks} refused: the pair is out of step since {self.broken}.")

    def _check(self, operation: str, status: int, started: float) -> None:
        if status != 0:
            local_ring.raise_failure(operation, status, self.group_ranks, self.peer, time.monotonic() - started,
                                     self.timeout, self.setting)


def _close_all() -> None:
    """At uninstall: unmap every pair segment of this process (their names are long unlinked)."""
    with _lock:
        for pair, _ in _pairs.values():
            if pair is not None:
                pair.library.ph_lp_close(pair.handle)
        _pairs.clear()


def _open(group, peer_in_group: int, seconds: float, setting: str):
    """Phase: the segment of this rank and its peer (made by the lower global rank)."""
    import paddle.distributed as dist

    lib, me, peer = local_ring.library(), dist.get_rank(), group.ranks[peer_in_group]
    ends = sorted((me, peer))
    end = ends.index(me)
    handle = local_ring.open_segment(
        ends, me, f"local_p2p/{group.id}/{ends[0]}-{ends[1]}",
        lambda name: lib.ph_lp_open(name, 1, end, LANE_BYTES), lambda name: lib.ph_lp_open(name, 0, end, LANE_BYTES),
        lib.ph_lp_close, f"point to point between ranks {ends} of gloo group {list(group.ranks)}", 2 * LANE_BYTES,
        seconds, setting)
    if handle is None:
        return None
    return _Pair(handle, list(group.ranks), peer, seconds, setting,
                 local_ring.spin_seconds(int(os.environ.get("PADDLE_LOCAL_SIZE", 2))))


def _pair(group, peer_in_group: int, config, operation: str):
    """The pair's segment, or None when the pair keeps gloo's path.  Made at the pair's first
    message, a rendezvous of the two (as gloo's first send waits for its receive too)."""
    process_group = getattr(group, "process_group", None)
    key = (group.id, tuple(group.ranks), id(process_group), peer_in_group)
    with _lock:
        if key in _pairs:
            return _pairs[key][0]
        pair = None
        if group.rank >= 0 and 0 <= peer_in_group < group.nranks and peer_in_group != group.rank and is_gloo(group):
            pair = local_ring.set_up(group, config, operation,
                                     lambda seconds, setting: _open(group, peer_in_group, seconds, setting))
        _pairs[key] = (pair, process_group)
        return pair


def _dense_cpu(tensor) -> bool:
    try:
        return (not tensor.is_dist()) and tensor.place.is_cpu_place()
    except (AttributeError, RuntimeError):
        return False


def _make_send(original, config):
    @functools.wraps(original)
    def _send_in_dygraph(tensor, dst_rank_in_group, group, sync_op, use_calc_stream):
        if _dense_cpu(tensor):
            pair = _pair(group, dst_rank_in_group, config, "send")
            if pair is not None:
                source = tensor if tensor.is_contiguous() else tensor.contiguous()
                pair.send(source.data_ptr(), nbytes(source))
                return local_ring._Done()
        return original(tensor, dst_rank_in_group, group, sync_op, use_calc_stream)

    return _send_in_dygraph


def _make_recv(original, config):
    @functools.wraps(original)
    def _recv_in_dygraph(tensor, src_rank_in_group, group, sync_op, use_calc_stream):
        if _dense_cpu(tensor):
            pair = _pair(group, src_rank_in_group, config, "recv")
            if pair is not None:
                if tensor.is_contiguous():
                    pair.recv(tensor.data_ptr(), nbytes(tensor))
                else:  # into a contiguous buffer, then into the caller's view (its strides kept)
                    import paddle

                    buffer = paddle.empty(tensor.shape, dtype=tensor.dtype)
                    pair.recv(buffer.data_ptr(), nbytes(buffer))
                    tensor.copy_(buffer, False)
                return local_ring._Done()
        return original(tensor, src_rank_in_group, group, sync_op, use_calc_stream)

    return _recv_in_dygraph


def _make_coalescing_manager(original):
    """``batch_isend_irecv`` wraps its ops in the process group's coalescing and hands the tasks
    to ``_end_coalescing``, which takes only the process group's own tasks: the finished tasks of
    this path are left out of that list (their work is done; the caller still waits on them)."""

    @contextlib.contextmanager
    def _coalescing_manager(group, tasks=None):
        if tasks is None:
            with original(group, tasks):
                yield
            return
        own = []
        with original(group, own):
            yield
            own.extend(t for t in tasks if not isinstance(t, local_ring._Done))

    return _coalescing_manager


def apply(config, patcher) -> str | None:
    """Phase: route the dygraph send/recv of one-node gloo groups through shared memory."""
    if not getattr(config, "local_p2p", True) or getattr(config, "fake_world", None) or not local_ring.eligible_job():
        return None
    import importlib

    where = "paddle.distributed.communication.stream"
    send, recv = (importlib.import_module(f"{where}.{name}") for name in ("send", "recv"))
    for module, name, make in ((send, "_send_in_dygraph", _make_send), (recv, "_recv_in_dygraph", _make_recv)):
        original = patcher.require(module, name, f"{where}.{module.__name__.rsplit('.', 1)[-1]}")
        patcher.set(module, name, make(original, config))
    batch = importlib.import_module("paddle.distributed.communication.batch_isend_irecv")
    original = patcher.require(batch, "_coalescing_manager", "paddle.distributed.communication.batch_isend_irecv")
    patcher.set(batch, "_coalescing_manager", _make_coalescing_manager(original))
    patcher.on_revert(_close_all, "the shared-memory point-to-point segments of this process")
    return "same-host gloo send/recv through shared memory (buffered)"
