"""Whether the hosts of the ranks a gloo wait timed out on, and the job's store, answer from here:
a rank cut off by the network says so instead of blaming its peer.

Why: after a 45-s network cut between two machines, both ranks timed out at the deadline, each
saying of the other "waiting for rank 1, which did not reach it (crashed, hung, or running other
code)": each sent the user to look for a crash on a machine that was fine.  Now
(:func:`look`, then :func:`partition_note`, added to the timeout's message by :mod:`.errors`)::

    rank 1's host 10.201.0.2 and the job's store are unreachable from here: a network partition or
    that host is down

How: one TCP connection attempt to each awaited rank's host (its endpoint in
``PADDLE_TRAINER_ENDPOINTS``, which Paddle's launcher sets) and to the job's store
(``PADDLE_MASTER``).  A connection made or refused is an answer: that host's kernel replied.
"Network unreachable", "no route to host" or no reply within :data:`PROBE_SECONDS` is none.  The
attempts run at once, each in a daemon thread, and the caller waits for them at most
:data:`PROBE_SECONDS` plus a margin in all: one stuck (a name to resolve) is left behind, never
waited for.  A rank on this machine is not asked about (no network lies between).

Limits: a host whose firewall drops connections to closed ports rather than refusing them looks
unreachable; a host that answers may still be cut off from the others by a partition elsewhere.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import socket
import threading
import time

__all__ = ["PROBE_SECONDS", "answers", "probe", "rank_endpoints", "store_endpoint", "Answers", "look",
           "partition_note"]

PROBE_SECONDS = 1.5
"""How long a host has to answer one connection attempt: a reachable host's kernel replies in
milliseconds, even across a loaded network."""

_MARGIN = 0.5  # seconds past PROBE_SECONDS the caller waits for the threads in all
_STORE = "the job's store"  # its key among the probed hosts
_NO_ANSWER = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN)


def _endpoint(text: str):
    host, _, port = text.strip().rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def rank_endpoints(environ=None) -> list:
    """``(host, port)`` of every global rank, in rank order (``PADDLE_TRAINER_ENDPOINTS``), or []."""
    environ = os.environ if environ is None else environ
    found = [_endpoint(e) for e in environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e.strip()]
    return found if all(found) else []


def store_endpoint(environ=None):
    """``(host, port)`` of the job's store, as Paddle's C++ reads it (``PADDLE_MASTER``, else the
    first trainer endpoint), or None."""
    environ = os.environ if environ is None else environ
    master = environ.get("PADDLE_MASTER")
    if master:
        return _endpoint(master)
    endpoints = rank_endpoints(environ)
    return endpoints[0] if endpoints else None


def answers(host: str, port: int, timeout: float = PROBE_SECONDS):
    """True when ``host`` answers a TCP connection to ``port`` (accepted or refused) within
    ``timeout`` seconds, False when it does not (no route, no reply), None when this cannot tell
    (another error)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError as exc:
        return False if exc.errno in _NO_ANSWER else None


def probe(endpoints: dict, timeout: float = PROBE_SECONDS) -> dict:
    """``{key: answers(*endpoint)}`` for ``{key: (host, port)}``, all at once, in at most
    ``timeout`` plus a margin: a probe not done by then reads None (unknown)."""
    results = {key: None for key in endpoints}

    def one(key, endpoint):
        results[key] = answers(*endpoint, timeout=timeout)

    threads = [threading.Thread(target=one, args=item, daemon=True, name="paddle_hybrid-probe")
               for item in endpoints.items()]
    give_up = time.monotonic() + timeout + _MARGIN  # one bound for all: they run at once
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, give_up - time.monotonic()))
    return dict(results)


@dataclasses.dataclass(frozen=True)
class Answers:
    """What answered from here: ``store`` (True, False, or None: unknown or not asked) and
    ``hosts``, ``{global rank: (its host, True/False/None)}`` for the ranks on other machines."""

    store: bool | None
    store_endpoint: tuple | None
    hosts: dict


def look(ranks: list, environ=None, timeout: float = PROBE_SECONDS) -> Answers:
    """Ask the job's store and the hosts of the global ``ranks`` (those not on this machine, each
    host once) at once, in at most ``timeout`` seconds plus a margin."""
    environ = os.environ if environ is None else environ
    endpoints = rank_endpoints(environ)
    mine = _endpoint(environ.get("PADDLE_CURRENT_ENDPOINT", ""))
    where = {r: endpoints[r] for r in ranks if 0 <= r < len(endpoints) and (mine is None or endpoints[r][0] != mine[0])}
    targets = {}
    for endpoint in where.values():
        targets.setdefault(endpoint[0], endpoint)
    store = store_endpoint(environ)
    if store is not None:
        targets[_STORE] = store
    answered = probe(targets, timeout) if targets else {}
    return Answers(store=answered.get(_STORE), store_endpoint=store,
                   hosts={r: (endpoint[0], answered.get(endpoint[0])) for r, endpoint in where.items()})


def partition_note(waited: list, answers: Answers):
    """What a timeout waiting for the global ranks ``waited`` should say when their hosts or the
    job's store did not answer (``answers``, from :func:`look`); None when all answered or nothing
    could be asked."""
    silent = sorted((rank, answers.hosts[rank][0]) for rank in waited
                    if rank in answers.hosts and answers.hosts[rank][1] is False)
    store_down = answers.store is False
    if silent:
        ranks = [rank for rank, _ in silent]
        hosts = ", ".join(dict.fromkeys(host for _, host in silent))
        one = len(silent) == 1
        who = f"rank {ranks[0]}'s host {hosts}" if one else f"the hosts of ranks {ranks} ({hosts})"
        down = "that host is down" if one else "those hosts are down"
        if store_down:
            return f"{who} and the job's store are unreachable from here: a network partition or {down}"
        store_note = " (the job's store answers)" if answers.store else ""
        return f"{who} {'is' if one else 'are'} unreachable from here{store_note}: a network partition or {down}"
    if store_down:
        host, port = answers.store_endpoint
        return f"the job's store ({host}:{port}) is unreachable from here: a network partition or its host is down"
    return None
