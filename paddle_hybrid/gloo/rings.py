"""Gloo rings for fleet's legacy static pipeline, a rendezvous of its own per ring.

Fleet's static meta optimizers ask ``CollectiveHelper._init_communicator`` for each ring (the
global ring, and one 2-rank ring per ordered pair of pipeline neighbours).  On a build without
CUDA or XPU it raises "comm_id must be generated ...": it only knows NCCL/BKCL id ops for the
startup program.  Here, on such a build, every member of a ring creates a gloo process group for
it (``core.ProcessGroupGloo`` on the ring's own store, ring ranks as fleet numbers them), which
:mod:`.lowering`'s point-to-point callbacks send and receive through; nothing is added to the
startup program.

Why process groups, not ``core.CommContextManager.create_gloo_comm_context`` for legacy ops:
the executor gives a legacy collective op on CPU its comm context through the one shared CPU
device context, and sets it only while that context has none
(``interpreter::SetDeviceCommContext``): the first ring a process uses serves every later op,
whatever its ``ring_id``.  A middle stage talks to two peers, and 1F1B interleaves the two
directions, so one context per process cannot carry a pipeline.

Why a rendezvous of its own per ring: several gloo contexts rendezvousing on the one global TCP
store mixed up the rank order of later rings and sometimes timed out on one rank only
(RESEARCH.md): gloo writes the same keys for every context.  Each ring rendezvouses on a view of
the job's store whose keys carry a prefix unique to this call
(:mod:`paddle_hybrid.gloo.prefix_store`; every rank calls ``_init_communicator`` the same number
of times in the same order, members or not, so a per-process call counter names the call alike
on every rank).  No store of its own, so no listening socket of its own.

Nothing waits forever: the rendezvous on the view ends at the static pipeline's deadline, and an
expired wait raises :class:`RingTimeoutError` naming the ring and its ranks.
"""
from __future__ import annotations

import functools
import itertools
import threading

# The setting a wait of the rings obeys, as messages name it (PluginConfig.seconds("static_pipeline_timeout")).
DEADLINE_SETTING = "PADDLE_HYBRID_TIMEOUT (or PADDLE_HYBRID_STATIC_PIPELINE_TIMEOUT when set)"

__all__ = ["DEADLINE_SETTING", "RingTimeoutError", "RingInfo", "rings", "make_init_communicator",
           "make_init_process_group", "ring", "ring_store", "close_all"]

_PREFIX = "paddle_hybrid/static_ring/{call}/{ring}/"
_GROUP_ID_BASE = 1 << 20  # process-group ids of the rings, clear of paddle.distributed's own


class RingTimeoutError(TimeoutError):
    """A rank of a static ring did not join in time."""


class RingInfo:
    """A ring this process is a member of: id, its rank in it, the global endpoints of its ranks,
    and (once created) its gloo process group."""

    def __init__(self, ring_id: int, rank: int, endpoints: list):
        self.ring_id, self.rank, self.endpoints = ring_id, rank, list(endpoints)
        self.group = None

    @property
    def nranks(self) -> int:
        return len(self.endpoints)

    def describe(self) -> str:
        return f"ring {self.ring_id} (ranks at {', '.join(self.endpoints)}; this process is ring rank {self.rank})"


rings: dict = {}
"""ring id -> :class:`RingInfo` of every ring this process created a gloo context for."""


def global_ranks(info: RingInfo) -> list | None:
    """The job's ranks of ``info``'s members (their endpoints' places in the job's), or None when an
    endpoint is not the job's."""
    import os

    job = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")
    try:
        return [job.index(endpoint) for endpoint in info.endpoints]
    except ValueError:
        return None


def ranks_of_group(process_group) -> list | None:
    """The job's ranks of a ring's process group, or None when it is no ring's."""
    for info in list(rings.values()):
        if info.group is process_group:
            return global_ranks(info)
    return None

_calls = itertools.count()


def ring(ring_id: int) -> RingInfo:
    """The :class:`RingInfo` of ``ring_id``; raises naming the fix when this process has no such ring."""
    info = rings.get(ring_id)
    if info is None:
        raise RuntimeError(
            f"paddle_hybrid.static.static_pipeline: ring {ring_id} has no gloo group in this process; it is created "
            "when fleet.distributed_optimizer(...).minimize(loss) runs with paddle_hybrid installed. Import "
            "paddle_hybrid before building the program.")
    return info


def _set_deadline(group, timeout: float) -> None:
    """The ring's gloo operations wait ``timeout`` (the static pipeline's deadline), not gloo's 30 s;
    where this Paddle does not allow it, gloo's 30 s stays and one warning says so."""
    import warnings

    from . import context_timeout as gloo_timeout

    try:
        gloo_timeout.set_timeout_ms(group, int(timeout * 1000))
    except gloo_timeout.GlooTimeoutUnavailable as exc:
        warnings.warn(f"paddle_hybrid.static.static_pipeline: the rings keep gloo's 30 s timeout ({exc}).",
                      RuntimeWarning, stacklevel=3)


def _global_store():
    from paddle.base import core

    from .groups import ensure_process_group

    from paddle.distributed import collective

    if 0 not in collective._group_map:  # else the default group made the job's TCP store already
        ensure_process_group()  # creates the job's TCP store (and the default gloo group) once
    return core.create_or_get_global_tcp_store()


def ring_store(info: RingInfo, call, timeout: float):
    """The view of the job's store ring ``info`` rendezvouses on; ``call`` names this creation
    alike on every rank, ``timeout`` bounds its waits."""
    from .prefix_store import prefix_store

    return prefix_store(_global_store(), _PREFIX.format(call=call, ring=info.ring_id), timeout,
                        f"the rendezvous of ring {info.ring_id} (every rank must build the same program with the "
                        f"same strategy; the deadline is {DEADLINE_SETTING})",
                        [f"ring rank {i} ({endpoint})" for i, endpoint in enumerate(info.endpoints)])


def close_all() -> None:
    """Forget every ring and its gloo group (at uninstall).  The groups' connections stay until the
    process ends: Paddle keeps each group in ``ProcessGroupIdMap`` and the comm-context manager,
    which release no single group (as for Paddle's own groups)."""
    for info in rings.values():
        info.group = None
    rings.clear()


def create_ring(info: RingInfo, call: int, timeout: float) -> None:
    """Create the gloo process group of ``info`` (collective over the ring's members)."""
    from paddle.base import core

    existing = rings.get(info.ring_id)
    if existing is not None:
        if (existing.rank, existing.endpoints) != (info.rank, info.endpoints):
            raise RuntimeError(
                f"paddle_hybrid.static.static_pipeline: ring {info.ring_id} exists with other members "
                f"({existing.describe()}); now asked for {info.describe()}. One process can hold one gloo "
                "group per ring id: build one pipeline program per process.")
        return  # the same ring again (a second program in this process): reuse it
    from . import fake_world

    if fake_world.active():  # a dry run: no peer to meet; its sends and receives answer at once
        from .groups import ensure_process_group

        ensure_process_group()  # the job's default group, as the real run makes it with its store
        info.group = fake_world.FakeProcessGroup(info.rank, info.nranks, _GROUP_ID_BASE + info.ring_id,
                                                 global_ranks(info))
        rings[info.ring_id] = info
        return
    try:
        store = ring_store(info, call, timeout)
        info.group = core.ProcessGroupGloo.create(store, info.rank, info.nranks, _GROUP_ID_BASE + info.ring_id)
    except RingTimeoutError:
        raise
    except Exception as exc:  # the store and gloo raise generic errors: say which ring
        raise RingTimeoutError(f"paddle_hybrid.static.static_pipeline: creating the gloo group of {info.describe()} "
                               f"failed: {exc}") from exc
    _set_deadline(info.group, timeout)
    rings[info.ring_id] = info


_pipeline_init = threading.local()  # .active: inside fleet's PipelineOptimizer._init_process_group


def make_init_process_group(original):
    """Fleet's ``PipelineOptimizer._init_process_group``, marking its ring requests as the
    pipeline's (the only ones this module serves)."""

    @functools.wraps(original)
    def _init_process_group(self, pipeline_pair, pipeline_ring_map):
        _pipeline_init.active = True
        try:
            return original(self, pipeline_pair, pipeline_ring_map)
        finally:
            _pipeline_init.active = False

    return _init_process_group


def make_init_communicator(original, timeout_of):
    """``CollectiveHelper._init_communicator`` that creates gloo rings for fleet's static pipeline
    where the original cannot (no CUDA, no XPU); every other call goes to the original, which
    keeps its own error for a CPU build.  ``timeout_of()`` gives the timeout."""

    @functools.wraps(original)
    def _init_communicator(self, program, current_endpoint, endpoints, rank, ring_id, wait_port,
                           global_ring_id=None, sync=True):
        from ..registry import device

        if device.cuda_build() or device.xpu_build() or not getattr(_pipeline_init, "active", False):
            return original(self, program, current_endpoint, endpoints, rank, ring_id, wait_port,
                            global_ring_id, sync)
        call = next(_calls)  # counted on members and non-members alike: same number on every rank
        if current_endpoint is None:
            return  # a non-member's "sync" call: the rendezvous of the members already synchronises
        create_ring(RingInfo(ring_id, rank, endpoints), call, timeout_of())

    return _init_communicator
