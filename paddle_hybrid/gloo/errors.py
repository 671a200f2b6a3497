"""A gloo operation that runs out of time says which rank it waited for and which setting bounds it.

Gloo's own message names neither (``[.../unbound_buffer.cc:80] TIMEOUT self_rank = none
pair_rank = -1 peer_str = none``), so a user of an 8-rank job cannot tell which rank hung or what
to raise.  Patch: the communication methods of ``core.ProcessGroupGloo`` (every collective and
p2p Paddle's Python API and fleet call on a gloo group: ``all_reduce``, ``broadcast``, ``send``,
``recv``, ...) re-raise gloo's timeout as :class:`GlooTimeoutError`, one line::

    paddle_hybrid: all_reduce on the gloo group of ranks [0, 1] timed out after 2 s
    (PADDLE_HYBRID_TIMEOUT) waiting for rank 1, which did not reach it (crashed, hung, or running
    other code); raise PADDLE_HYBRID_TIMEOUT if that rank is only slow. gloo: TIMEOUT ...

**A rank cut off by the network says so.**  Before the message is made, the hosts of the group's
other ranks (those on other machines) and the job's store are asked for an answer, all at once
and for at most two seconds (:mod:`.reachable`).  When the ranks waited for, or the store, do not
answer, the message says that instead of "crashed, hung, or running other code"::

    ... timed out after 20 s (PADDLE_HYBRID_TIMEOUT) waiting for rank 1: rank 1's host 10.201.0.2
    and the job's store are unreachable from here: a network partition or that host is down; raise
    PADDLE_HYBRID_TIMEOUT to outlast longer network cuts. gloo: TIMEOUT ...

A store that does not answer is not asked which ranks arrived (that question would wait for the
network, not for the naming window).

Which rank was waited for:

* ``send``/``recv``: the peer;
* a group of two: the other rank;
* a larger group: every rank of the group that times out in the same operation says so in the
  job's store (one ``add`` to a presence counter, :mod:`paddle_hybrid.common.exchange`) and waits
  up to :func:`naming_window` seconds for the others; the ranks that did not say so are named.
  A rank late by less than the window may be named with the hung one; the message says "no sign
  within N s" then.  A rank that arrives after this one timed out times out itself no earlier than
  one deadline later, which is why the window is at most half the deadline.  Operations are
  matched by a per-group count of the calls made through these methods, the same on every rank of
  a correct program.

**A peer that died is not a timeout.**  Gloo reports a connection its peer closed (the peer
exited, crashed or was killed) with the same ``TIMEOUT`` message, at once: a survivor used to say
"timed out after 600 s" 0.02 s after the death.  Other survivors get ``Read error ...: Connection
reset by peer``, which names an address, not a rank.  A gloo timeout raised before half the
deadline has passed, and a reset or closed connection, are therefore re-raised as
:class:`GlooPeerLostError`, naming the rank gloo's pair was connected to (its ``pair_rank``, a
place in the group; the peer of a send/recv; the other rank of a group of two), else the ranks of
the group that did not also report the loss in the job's store within the naming window (every
survivor reports it, also one that knows the rank at once)::

    paddle_hybrid: all_reduce on the gloo group of ranks [0, 1] lost rank 1 after 0.02 s:
    connection closed by peer (that rank exited, crashed or was killed; its own log says why);
    not a timeout (the deadline is 600 s, PADDLE_HYBRID_TIMEOUT). gloo: ...

Its wording ("closed by peer") is what the launcher counts as a failure caused by another rank.

**A DistTensor is refused before it reaches gloo.**  A process group's methods take dense tensors;
given an auto-parallel DistTensor (fleet's tensor-parallel layers fed by a semi-auto model, seen
with PaddleFormers' auto-parallel Trainer) the gloo process group reads it as a dense tensor and
the process dies of a segmentation fault, with no message.  Now :class:`GlooDistTensorError`
names the operation, the argument and what to pass instead (its ``_local_value()``, or dense
tensors throughout).

Nothing is added to an operation that completes: one dict increment, a clock read and a look at
the arguments per call.
Other errors pass through unchanged.  Not covered: collectives Paddle calls from C++ without this Python method (the
DataParallel reducer, static-graph and ``_C_ops`` communication ops) keep gloo's message.
"""
from __future__ import annotations

import collections
import functools
import re
import time

from ..common import exchange
from . import context_timeout as gloo_timeout
from . import reachable

__all__ = ["apply", "GlooTimeoutError", "GlooPeerLostError", "GlooDistTensorError", "OPERATIONS", "naming_window",
           "is_gloo_timeout", "lost_peer_before"]

# ProcessGroup methods that communicate; those this Paddle lacks are skipped.  Not the all-to-alls:
# gloo has none, the expert_parallel component replaces them with send/recv, which are named here.
OPERATIONS = (
    "all_reduce", "all_reduce_on_calc_stream", "allreduce", "broadcast", "broadcast_on_calc_stream",
    "all_gather", "all_gather_on_calc_stream", "all_gather_into_tensor", "all_gather_into_tensor_on_calc_stream",
    "all_gather_partial", "all_gather_partial_on_calc_stream", "reduce", "reduce_on_calc_stream",
    "reduce_scatter", "reduce_scatter_on_calc_stream", "reduce_scatter_tensor", "reduce_scatter_tensor_on_calc_stream",
    "scatter", "scatter_on_calc_stream", "scatter_tensor", "scatter_tensor_on_calc_stream", "gather", "barrier",
    "send", "send_on_calc_stream", "send_partial", "send_partial_on_calc_stream",
    "recv", "recv_on_calc_stream", "recv_partial", "recv_partial_on_calc_stream",
)
_P2P = re.compile(r"^(send|recv)")
_TIMEOUT = re.compile(r"\bTIMEOUT\b|timed out", re.IGNORECASE)
_PAIR_RANK = re.compile(r"pair_rank = (\d+)")
_CLOSED = re.compile(r"connection (?:reset|closed) by peer|closed by peer|broken pipe", re.IGNORECASE)
_MAX_WINDOW = 5.0  # seconds a timed-out rank waits to learn which peers timed out with it

# id(process group object) -> calls made through the patched methods: the operation's number.
_calls: collections.Counter = collections.Counter()


class GlooTimeoutError(RuntimeError):
    """A gloo operation ran past its group's deadline. ``operation``, ``group_ranks`` (global),
    ``waited_for`` (global ranks), ``seconds`` (the deadline), ``setting`` (what sets it)."""

    def __init__(self, message, *, operation, group_ranks, waited_for, seconds, setting):
        super().__init__(message)
        self.operation, self.group_ranks, self.waited_for = operation, group_ranks, waited_for
        self.seconds, self.setting = seconds, setting


class GlooDistTensorError(TypeError):
    """A gloo operation was given an auto-parallel DistTensor (the process would have crashed)."""


def _dist_tensor_argument(args, kwargs):
    """Where a DistTensor sits among a call's arguments ("argument 1", "argument 0[2]", ...), or None."""
    import paddle

    def found(value):
        return isinstance(value, paddle.Tensor) and value.is_dist()

    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", a) for k, a in kwargs.items()]
    for where, value in named:
        if found(value):
            return where
        if isinstance(value, (list, tuple)):
            for j, item in enumerate(value):
                if found(item):
                    return f"{where}[{j}]"
    return None


def _refuse_dist_tensors(operation, args, kwargs) -> None:
    where = _dist_tensor_argument(args, kwargs)
    if where is not None:
        raise GlooDistTensorError(
            f"paddle_hybrid: {operation} on a gloo process group was given an auto-parallel DistTensor ({where}); "
            "a process group takes dense tensors and gloo would read it as one and crash the process. Pass its "
            "local part (tensor._local_value()), or keep this code's tensors dense: fleet's tensor-parallel layers "
            "and collectives do not take semi-auto DistTensors.")


class GlooPeerLostError(RuntimeError):
    """A gloo operation failed long before its deadline because a peer closed its connection.
    ``operation``, ``group_ranks`` (global), ``lost`` (global ranks named; several when only the
    store could tell, empty when nothing could), ``peer`` (the one rank when exactly one is named,
    else None), ``seconds`` (how long the operation ran), ``deadline`` (seconds)."""

    def __init__(self, message, *, operation, group_ranks, lost, seconds, deadline):
        super().__init__(message)
        self.operation, self.group_ranks, self.lost = operation, group_ranks, lost
        self.peer = lost[0] if len(lost) == 1 else None
        self.seconds, self.deadline = seconds, deadline


def lost_peer_before(elapsed: float, deadline: float | None) -> bool:
    """Whether a gloo "timeout" after ``elapsed`` seconds is a closed connection: it came before
    half of a known deadline."""
    return deadline is not None and elapsed < deadline / 2


def is_gloo_timeout(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and _TIMEOUT.search(str(exc)) is not None


def naming_window(deadline_seconds: float | None) -> float:
    """How long a timed-out rank of a group larger than two waits for the peers that timed out with it."""
    if deadline_seconds is None:
        return _MAX_WINDOW
    return min(_MAX_WINDOW, deadline_seconds / 2)


def _group_of(process_group):
    """Paddle's ``Group`` holding ``process_group`` (its id and global ranks), or None."""
    from paddle.distributed.communication.group import _GroupManager

    for group in list(_GroupManager.group_map_by_id.values()):
        if getattr(group, "process_group", None) is process_group:
            return group
    return None


def _deadline(process_group, config):
    """(seconds, the setting's name) of this group's deadline as its gloo context holds it."""
    try:
        milliseconds = gloo_timeout.get_timeout_ms(process_group)
    except Exception:  # noqa: BLE001  (naming is best effort; the timeout itself is raised anyway)
        return None, "PADDLE_HYBRID_TIMEOUT"
    seconds = milliseconds / 1000
    if abs(seconds - config.timeout) < 1e-3:
        return seconds, "PADDLE_HYBRID_TIMEOUT"
    return seconds, "the timeout given to new_group"


def _peer(operation: str, args, kwargs, ranks: list):
    """Global rank of a send/recv's peer (its second argument, a rank in the group), or None."""
    index = args[1] if len(args) > 1 else kwargs.get("src" if operation.startswith("recv") else "dst")
    if isinstance(index, int) and 0 <= index < len(ranks):
        return ranks[index]
    return None


def _who_did_not_arrive(group, number: int, rank: int, window: float):
    """Ranks of ``group`` that did not time out in its operation ``number`` within ``window`` s;
    None when the job's store cannot be asked."""
    ranks = sorted(group.ranks)
    key = f"paddle_hybrid/gloo_timeout/{'-'.join(map(str, ranks))}/{group.id}/{number}"
    try:
        store = exchange.job_store()
        seen = exchange.arrive(store, key, ranks, rank)
        return exchange.wait_for(store, key, ranks, seen, window)
    except Exception:  # noqa: BLE001  (the store's host may be the rank that died)
        return None


def _waited_for(operation, args, kwargs, group, number, rank, seconds, ask_store=True):
    """(global ranks waited for, how sure): "exact", "window" (no sign within the window) or
    "unknown" (also when the store is not to be asked: it did not answer)."""
    others = [r for r in sorted(group.ranks) if r != rank]
    if _P2P.match(operation):
        peer = _peer(operation, args, kwargs, list(group.ranks))  # local rank i is group.ranks[i]
        if peer is not None:
            return [peer], "exact"
    if len(others) == 1:
        return others, "exact"
    if not ask_store:
        return others, "unknown"
    missing = _who_did_not_arrive(group, number, rank, naming_window(seconds))
    if missing is None:
        return others, "unknown"
    return (missing or others), ("window" if missing else "unknown")


def is_closed_connection(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and _CLOSED.search(str(exc)) is not None


def _known_peer(operation, args, kwargs, group, rank, raw):
    """Global rank of the peer whose connection closed when the error itself tells: gloo's
    ``pair_rank`` (a place in the group), the peer of a send/recv, the other rank of two."""
    ranks = sorted(group.ranks)
    found = _PAIR_RANK.search(str(raw))
    if found and int(found.group(1)) < len(ranks):
        return ranks[int(found.group(1))]
    if _P2P.match(operation):
        peer = _peer(operation, args, kwargs, list(group.ranks))
        if peer is not None:
            return peer
    others = [r for r in ranks if r != rank]
    return others[0] if len(others) == 1 else None


def _lost_peers(operation, args, kwargs, group, number, rank, raw, deadline):
    """Global ranks lost: the one the error names, else those that did not report the same
    loss in the job's store within the naming window.  Every survivor reports it first.  The
    store may go down in the window (its host was a survivor that has exited by now): then the
    ranks not seen before that."""
    ranks = sorted(group.ranks)
    key = f"paddle_hybrid/gloo_peer_lost/{'-'.join(map(str, ranks))}/{group.id}/{number}"
    known = _known_peer(operation, args, kwargs, group, rank, raw)
    seen = None
    try:
        store = exchange.job_store()
        seen = exchange.arrive(store, key, ranks, rank)
        if known is not None:
            return [known]
        return exchange.wait_for(store, key, ranks, seen, naming_window(deadline))
    except Exception:  # noqa: BLE001  (the store's host may have exited or died)
        if known is not None:
            return [known]
        return exchange.missing(ranks, seen) if seen is not None else []


def _lost_message(operation, group_ranks, lost, elapsed, deadline, setting, raw):
    who = exchange.describe_ranks(lost) if lost else "a peer"
    gloo = " ".join(str(raw).split())
    deadline_note = f" (the deadline is {deadline:g} s, {setting})" if deadline is not None else ""
    return (f"paddle_hybrid: {operation} on the gloo group of ranks {group_ranks} lost {who} after {elapsed:.2f} s: "
            f"connection closed by peer (that rank exited, crashed or was killed; its own log says why); not a "
            f"timeout{deadline_note}. gloo: {gloo}")


def _message(operation, group_ranks, waited, sureness, seconds, setting, window, raw, unreachable=None):
    """The timeout's one line; ``unreachable``: what did not answer from here (:mod:`.reachable`)."""
    after = f"after {seconds:g} s " if seconds is not None else ""
    who = exchange.describe_ranks(waited)
    gloo = " ".join(str(raw).split())
    if unreachable:
        return (f"paddle_hybrid: {operation} on the gloo group of ranks {group_ranks} timed out {after}({setting}) "
                f"waiting for {who}: {unreachable}; raise {setting} to outlast longer network cuts. gloo: {gloo}")
    if sureness == "exact":
        waiting = f"waiting for {who}, which did not reach it (crashed, hung, or running other code)"
    elif sureness == "window":
        waiting = (f"waiting for {who}: no sign within {window:g} s that they reached it (crashed, hung, late or "
                   "running other code)")
    else:
        waiting = f"waiting for one of {who} (which one could not be learned from the job's store)"
    return (f"paddle_hybrid: {operation} on the gloo group of ranks {group_ranks} timed out {after}({setting}) "
            f"{waiting}; raise {setting} if that rank is only slow. gloo: {gloo}")


def _make_named(operation: str, original, config):
    @functools.wraps(original)
    def named(self, *args, **kwargs):
        _refuse_dist_tensors(operation, args, kwargs)
        number = _calls[id(self)]
        _calls[id(self)] = number + 1
        started = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        except RuntimeError as exc:
            timeout, closed = is_gloo_timeout(exc), is_closed_connection(exc)
            if not (timeout or closed):
                raise
            elapsed = time.monotonic() - started
            group = _group_of(self)
            if group is None:
                raise
            import paddle.distributed as dist

            rank = dist.get_rank()
            seconds, setting = _deadline(self, config)
            if closed or lost_peer_before(elapsed, seconds):
                group_ranks = sorted(group.ranks)
                lost = _lost_peers(operation, args, kwargs, group, number, rank, exc, seconds)
                raise GlooPeerLostError(_lost_message(operation, group_ranks, lost, elapsed, seconds, setting, exc),
                                        operation=operation, group_ranks=group_ranks, lost=lost, seconds=elapsed,
                                        deadline=seconds) from exc
            group_ranks = sorted(group.ranks)
            answers = reachable.look([r for r in group_ranks if r != rank])
            waited, sureness = _waited_for(operation, args, kwargs, group, number, rank, seconds,
                                           ask_store=answers.store is not False)
            message = _message(operation, group_ranks, waited, sureness, seconds, setting, naming_window(seconds), exc,
                               unreachable=reachable.partition_note(waited, answers))
            raise GlooTimeoutError(message, operation=operation, group_ranks=group_ranks, waited_for=waited,
                                   seconds=seconds, setting=setting) from exc

    return named


def apply(config, patcher) -> None:
    """Phase: wrap each communication method ``core.ProcessGroupGloo`` has (inherited from
    ``ProcessGroup``; the wrapper is set on the gloo class only, so NCCL/BKCL groups are untouched)."""
    from paddle.base import core

    gloo_class = patcher.require(core, "ProcessGroupGloo", "paddle.base.core")
    for operation in OPERATIONS:
        original = getattr(gloo_class, operation, None)
        if callable(original):
            patcher.set(gloo_class, operation, _make_named(operation, original, config))
