"""The prefix view of a store (``custom_ops/prefix_store.cc`` through ``common.prefix_store``): keys
under the prefix on the store it wraps, waits bounded by its own deadline, accepted by Paddle as a
``Store`` (a gloo group is created on it), and clear errors."""
import re
import socket
import sys
import time

import pytest
from paddle.base import core

from paddle_hybrid.gloo.prefix_store import prefix_store
from paddle_hybrid.ops import BUILD_COMMAND


@pytest.fixture
def job_store():
    with socket.socket() as s:  # a free port (the store binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return core.TCPStore("127.0.0.1", port, True, 1, 30)


def test_keys_live_under_the_prefix(job_store):
    view = prefix_store(job_store, "group/7/", 5, "test")
    assert isinstance(view, core.Store)
    view.set("0", b"address")
    assert job_store.get("group/7/0") == b"address"
    assert view.get("0") == b"address"
    assert view.add("count", 2) == 2 and job_store.add("group/7/count", 1) == 3
    assert job_store.add("group/7/count/.written", 0) == 1 and job_store.add("group/7/absent/.written", 0) == 0
    other = prefix_store(job_store, "group/8/", 5, "test")
    other.set("0", b"elsewhere")
    assert view.get("0") == b"address"  # groups never read each other's keys


def test_a_wait_ends_at_its_own_deadline_naming_the_key_owner_and_rank(job_store):
    view = prefix_store(job_store, "group/9/", 0.3, "rendezvous of gloo group 9 (deadline PADDLE_HYBRID_TIMEOUT)",
                        ["rank 4", "rank 7"])
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        view.get("1")
    took = time.monotonic() - start
    assert 0.3 <= took < 5, took  # the job's store alone would wait its 30 s
    message = str(caught.value)
    assert "key 'group/9/1' was not set within 0.3 s" in message, message
    assert "rendezvous of gloo group 9 (deadline PADDLE_HYBRID_TIMEOUT)" in message, message
    assert "rank 7 did not reach the rendezvous" in message, message  # key "1": place 1 of the group
    with pytest.raises(RuntimeError, match="a peer did not reach"):
        view.get("not-a-place")  # a key that is no rank's


def test_paddle_creates_a_gloo_group_on_it(job_store, monkeypatch):
    import paddle

    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    group = core.ProcessGroupGloo.create(prefix_store(job_store, "group/10/", 5, "test"), 0, 1, 10)
    x = paddle.to_tensor([1.0, 2.0])
    group.all_reduce(x, core.ReduceOp.SUM, True).wait()
    assert x.tolist() == [1.0, 2.0]
    assert job_store.add("group/10/0/.written", 0) == 1  # gloo's rendezvous wrote rank 0's address there


def test_bad_arguments_are_refused(job_store):
    with pytest.raises(ValueError, match="timeout > 0"):
        prefix_store(job_store, "p/", 0, "test")
    with pytest.raises(ValueError, match="needs a store"):
        prefix_store(None, "p/", 1, "test")


def test_a_missing_extension_names_the_build_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "paddle_hybrid._prefix_store", None)  # import fails as if absent
    with pytest.raises(ImportError, match=re.escape(BUILD_COMMAND)):
        prefix_store(object(), "p/", 1, "test")
