"""Every rank's small description of itself, read by every rank: through the job's TCP store, as
JSON, with a deadline that names the ranks that did not arrive.

Used where ranks must agree before training (the start-up agreement, the gradient-layout
checks) and where rank 0 gathers what every rank recorded (the timeline).  Why not
``paddle.distributed.all_gather_object``:

* it unpickles what the other ranks send: a socket's bytes become code.  JSON cannot;
* it is a collective: on gloo it fails after gloo's own 30 s whatever deadline the user set, a
  timed-out one leaves a thread blocked in it that pairs with the group's next collective, and
  its error does not say which rank is missing.  Reading the store with ``add(key, 0)`` (a
  counter read that does not block) polls until the user's deadline, names every missing rank
  (each rank adds its own bit to a presence counter), and leaves nothing behind.

Keys are ``paddle_hybrid/<topic>/<n>/...`` where ``n`` counts this process's exchanges of that
topic among those ranks: every rank makes the same exchanges in the same order, so the n-th of
one rank meets the n-th of the others.
"""
from __future__ import annotations

import collections
import json
import time

__all__ = ["ExchangeTimeout", "exchange", "answer_for_every_rank", "job_store", "arrive",
           "wait_for", "missing", "describe_ranks", "AgreementError", "differences"]

_POLL = 0.005  # seconds between two reads of the store's counters
_counts: collections.Counter = collections.Counter()
_ALONE = {"on": False}


def answer_for_every_rank(on: bool = True) -> None:
    """This process stands for every rank of its job and no peer will publish (the dry run's fake world,
    :mod:`paddle_hybrid.gloo.fake_world`): from now on an exchange returns this rank's payload as every
    rank's, as that world's all_gather does, instead of waiting out the deadline."""
    _ALONE["on"] = on


class ExchangeTimeout(TimeoutError):
    """Some ranks did not publish within the deadline; ``missing`` holds their global ranks."""

    def __init__(self, message: str, missing: list):
        super().__init__(message)
        self.missing = missing


def job_store():
    """The job's TCP store (Paddle's global store; created with the default process group)."""
    import paddle.distributed as dist
    from paddle.base import core

    if not dist.is_initialized():
        raise RuntimeError("paddle_hybrid: the ranks cannot compare anything before paddle.distributed is "
                           "initialised (fleet.init or paddle.distributed.init_parallel_env).")
    return core.create_or_get_global_tcp_store()


def describe_ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class AgreementError(RuntimeError):
    """The ranks of a job started with settings that must be equal and are not."""


def differences(by_rank: dict) -> list:
    """``["<field>: rank 0: 4, rank 1: 2", ...]`` for every field whose value is not the same on
    every rank of ``{rank: {field: value}}`` (a field a rank lacks reads ``(missing)``)."""
    fields = sorted({f for run in by_rank.values() for f in run})
    found = []
    for field in fields:
        groups: dict = {}
        for rank in sorted(by_rank):
            value = by_rank[rank].get(field, "(missing)")
            groups.setdefault(repr(value), []).append(rank)
        if len(groups) > 1:
            found.append(f"{field}: " + ", ".join(f"{describe_ranks(ranks)}: {value}" for value, ranks in groups.items()))
    return found


_BITS = 62  # ranks per presence counter: one bit each, the sum stays inside a signed 64-bit integer


def exchange(payload, *, topic: str, ranks: list, rank: int, timeout: float, setting: str, store=None) -> dict:
    """Publish ``payload`` (JSON-serialisable; anything else is written with ``str``) as global
    rank ``rank`` and return ``{global rank: payload}`` of every rank in ``ranks``.

    Raises :class:`ExchangeTimeout` after ``timeout`` seconds naming the ranks that did not
    publish and ``setting``, the deadline's name (``PADDLE_HYBRID_TIMEOUT``).

    Each store request is a round trip (about 40 ms on one machine: the store's client waits for
    the delayed acknowledgement of its request), so the happy path makes few: the value is ``set``
    (no reply awaited); arriving is one ``add`` of this rank's bit to a presence counter, whose sum
    says who has arrived; then one ``get`` per other rank."""
    if _ALONE["on"]:
        mine = json.loads(json.dumps(payload, sort_keys=True, default=str))
        return {r: mine for r in sorted(ranks)}
    store = store if store is not None else job_store()
    ranks = sorted(ranks)
    scope = f"paddle_hybrid/{topic}/{'-'.join(map(str, ranks))}"
    n = _counts[scope]
    _counts[scope] += 1
    key = f"{scope}/{n}"
    text = json.dumps(payload, sort_keys=True, default=str)
    store.set(f"{key}/{rank}", text)
    seen = arrive(store, key, ranks, rank)
    waiting = wait_for(store, key, ranks, seen, timeout)
    if waiting:
        raise ExchangeTimeout(
            f"paddle_hybrid: {topic}: waited {timeout:g} s for {describe_ranks(waiting)}, which did not "
            f"arrive (crashed, hung, or running other code). The deadline is {setting}; raise it if "
            "those ranks are only slow.", waiting)
    return {r: (json.loads(text) if r == rank else json.loads(store.get(f"{key}/{r}"))) for r in ranks}


def arrive(store, key: str, ranks: list, rank: int) -> dict:
    """Say that global rank ``rank`` (one of the sorted ``ranks``) has reached ``key``: one ``add``
    of its bit to a presence counter.  Returns what :func:`wait_for` starts from."""
    index = ranks.index(rank)
    return {index // _BITS: store.add(f"{key}/present/{index // _BITS}", 1 << (index % _BITS))}


def missing(ranks: list, seen: dict) -> list:
    """The ranks (of the sorted ``ranks``) whose presence bit ``seen`` lacks."""
    return [r for i, r in enumerate(ranks) if not (seen.get(i // _BITS, 0) >> (i % _BITS)) & 1]


def wait_for(store, key: str, ranks: list, seen: dict, timeout: float) -> list:
    """Poll the presence counters of ``key`` for at most ``timeout`` seconds; the ranks (of the
    sorted ``ranks``) that have not arrived by then, ``[]`` as soon as all have."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = missing(ranks, seen)
        if not waiting or time.monotonic() >= deadline:
            return waiting
        time.sleep(_POLL)
        for chunk in {ranks.index(r) // _BITS for r in waiting}:
            seen[chunk] = store.add(f"{key}/present/{chunk}", 0)
