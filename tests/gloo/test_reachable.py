"""A gloo timeout names a network partition when the awaited rank's host and the job's store do
not answer from here (``gloo.reachable``, used by ``gloo.errors``), and keeps "crashed, hung, or
running other code" when they do; the probe keeps its bound.  Without a network: a host that
answers is a closed port on loopback (refused at once); one that does not is a listening socket
whose accept queue is full (Linux drops the SYN, so the connection gets no reply, as across a cut
link).  Across two network namespaces: ``tests/launch/test_several_machines.py``.

Seen failing first: without the probe the timeout's message said "which did not reach it (crashed,
hung, or running other code)" of a rank whose host did not answer (the test of the message)."""
import errno
import socket
import time
import types

import pytest

from paddle_hybrid.gloo import errors, reachable


@pytest.fixture
def silent():
    """``(host, port)`` that accepts no connection and refuses none: a listening socket on
    127.0.0.2 with a full accept queue."""
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(0)
    filling = []
    for _ in range(3):  # a backlog of 0 still queues one; the rest wait in SYN_SENT
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(listener.getsockname())
        filling.append(s)
    time.sleep(0.1)
    yield listener.getsockname()
    for s in filling:
        s.close()
    listener.close()


@pytest.fixture
def refused():
    """``(host, port)`` of a closed port on loopback: refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()


@pytest.fixture
def accepting():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield listener.getsockname()
    listener.close()


def test_an_answer_is_a_connection_made_or_refused_and_silence_is_none(silent, refused, accepting):
    assert reachable.answers(*refused) is True
    assert reachable.answers(*accepting) is True
    started = time.monotonic()
    assert reachable.answers(*silent, timeout=0.5) is False
    assert 0.4 < time.monotonic() - started < 1.5


def test_no_route_is_no_answer(monkeypatch):
    def unreachable(*_args, **_kwargs):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(reachable.socket, "create_connection", unreachable)
    assert reachable.answers("10.201.0.1", 1) is False


def test_probes_run_at_once_within_one_bound(silent, refused):
    started = time.monotonic()
    got = reachable.probe({"a": silent, "b": silent, "c": refused}, timeout=0.5)
    assert got == {"a": False, "b": False, "c": True}
    assert time.monotonic() - started < 0.5 + 0.5 + 0.4  # the timeout and the margin, once


def _env(rank_endpoints, store, mine="127.0.0.1:1"):
    return {"PADDLE_TRAINER_ENDPOINTS": ",".join(f"{h}:{p}" for h, p in rank_endpoints),
            "PADDLE_MASTER": f"{store[0]}:{store[1]}", "PADDLE_CURRENT_ENDPOINT": mine}


def test_the_note_names_what_did_not_answer(silent, refused, accepting):
    # rank 1 on a silent host, the store silent too: the wording
    answers = reachable.look([1], _env([("127.0.0.1", 1), silent], store=silent), timeout=0.5)
    assert reachable.partition_note([1], answers) == (
        "rank 1's host 127.0.0.2 and the job's store are unreachable from here: a network partition or that "
        "host is down")
    # the store answers (this rank's side of the cut hosts it)
    answers = reachable.look([1], _env([("127.0.0.1", 1), silent], store=accepting), timeout=0.5)
    assert reachable.partition_note([1], answers) == (
        "rank 1's host 127.0.0.2 is unreachable from here (the job's store answers): a network partition or that "
        "host is down")
    # everything answers: nothing to add, the rank hung or crashed
    answers = reachable.look([1], _env([("127.0.0.1", 1), refused], store=accepting), timeout=0.5)
    assert reachable.partition_note([1], answers) is None
    # a rank on this machine is not asked about; the store alone is named
    answers = reachable.look([1], _env([("127.0.0.1", 1), ("127.0.0.1", 2)], store=silent), timeout=0.5)
    assert answers.hosts == {}
    assert reachable.partition_note([1], answers) == (
        f"the job's store (127.0.0.2:{silent[1]}) is unreachable from here: a network partition or its host is down")
    # nothing known (no launcher's variables): nothing asked, nothing said
    answers = reachable.look([1], {}, timeout=0.5)
    assert answers.hosts == {} and answers.store is None and reachable.partition_note([1], answers) is None


def _timeout_raised_by_gloo(monkeypatch, environ, nranks=2):
    """The error the wrapped gloo method raises when gloo times out on a group of ``nranks``
    (rank 0 of it, deadline 0.1 s), in this process, under the launcher's variables ``environ``."""
    import paddle.distributed as dist

    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    group = types.SimpleNamespace(ranks=list(range(nranks)), id=77)
    monkeypatch.setattr(errors, "_group_of", lambda _pg: group)
    monkeypatch.setattr(errors, "_deadline", lambda _pg, _config: (0.1, "PADDLE_HYBRID_TIMEOUT"))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)

    def gloo_all_reduce(self, *args, **kwargs):
        time.sleep(0.1)
        raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] TIMEOUT self_rank = none pair_rank = -1")

    wrapped = errors._make_named("all_reduce", gloo_all_reduce, config=None)
    started = time.monotonic()
    with pytest.raises(errors.GlooTimeoutError) as caught:
        wrapped(object())
    return str(caught.value), time.monotonic() - started


def test_a_timeout_whose_peer_and_store_do_not_answer_names_a_partition(monkeypatch, silent):
    message, took = _timeout_raised_by_gloo(monkeypatch, _env([("127.0.0.1", 1), silent], store=silent))
    assert ("timed out after 0.1 s (PADDLE_HYBRID_TIMEOUT) waiting for rank 1: rank 1's host 127.0.0.2 and the "
            "job's store are unreachable from here: a network partition or that host is down; raise "
            "PADDLE_HYBRID_TIMEOUT to outlast longer network cuts. gloo: ") in message, message
    assert "crashed" not in message
    assert took < 0.1 + reachable.PROBE_SECONDS + 1.0, took  # the probe's bound, once


def test_a_timeout_whose_peer_answers_still_says_it_did_not_reach_it(monkeypatch, refused, accepting):
    message, took = _timeout_raised_by_gloo(monkeypatch, _env([("127.0.0.1", 1), refused], store=accepting))
    assert "waiting for rank 1, which did not reach it (crashed, hung, or running other code)" in message, message
    assert "unreachable" not in message and took < 1.0, took


def test_a_store_that_does_not_answer_is_not_asked_who_arrived(monkeypatch, silent, refused):
    """A group of three: the store would be asked which ranks timed out with this one; unreachable,
    it is not (the question would wait on the network), and both others are named."""
    asked = []
    monkeypatch.setattr(errors, "_who_did_not_arrive", lambda *a: asked.append(a) or [2])
    message, took = _timeout_raised_by_gloo(
        monkeypatch, _env([("127.0.0.1", 1), refused, refused], store=silent), nranks=3)
    assert not asked
    assert "waiting for ranks [1, 2]: the job's store (127.0.0.2:" in message, message
    assert took < 0.1 + reachable.PROBE_SECONDS + 1.0, took
