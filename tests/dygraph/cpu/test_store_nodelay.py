"""The job's store without Nagle's delay (``cpu/tcp_store.py``, part 2): every socket of the job's
store, on both ranks (the client connections, and on rank 0 the listening socket and the
connections it accepted), has ``TCP_NODELAY`` with the plugin.  With
``PADDLE_HYBRID_STORE_NODELAY=0`` (the code without the change) the clients' connections lack it:
Paddle's server sets it on the connections it accepts, its client on none.
What it buys is measured in ``benchmarks/bench_startup_agreement.py``, not here."""
import os

import pytest

from paddle_hybrid.testing import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_store_nodelay.py")


@pytest.mark.parametrize("setting", ["1", "0"])
def test_every_socket_of_the_job_store(setting):
    results = launch(WORKER, nprocs=2, timeout=120, env={"PADDLE_HYBRID_STORE_NODELAY": setting})
    by_rank = {r["rank"]: [tuple(s) for s in r["sockets"]] for r in results}
    # rank 0 hosts the store: it listens, accepted both ranks' connections, and is a client itself
    assert sorted(role for role, _ in by_rank[0]) == ["accepted", "accepted", "client", "listening"], by_rank
    assert [role for role, _ in by_rank[1]] == ["client"], by_rank
    for rank, sockets in by_rank.items():
        for role, value in sockets:
            if setting == "1" or role == "client":
                assert bool(value) == (setting == "1"), (setting, rank, sockets)
