"""The root cause of a failed ``python -m paddle_hybrid.launch`` job, with real processes.

Rank 1 dies right after the process group is up; rank 0, blocked in an ``all_reduce``, fails
with gloo's "Connection reset by peer" within milliseconds of it, usually before Paddle's
launcher looks again (Paddle's polls once a second, the plugin's every 50 ms).  Paddle's rule (lowest failed rank) then names
rank 0; the launcher must name rank 1, every time, exit with its code, and show its log.
Also: the exit watcher leaves reaping to ``Popen`` (Paddle's ``poll()`` still gets the code).
"""
import functools
import os
import subprocess
import sys
import time

import pytest

from paddle_hybrid.launch import exit_code as ec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import root_cause_job  # noqa: E402  (benchmarks/root_cause_job.py: the benchmark's job, run here too)

# the launcher's exit watcher and its rule (not Paddle's version): one CI lane, tests/conftest.py
pytestmark = pytest.mark.one_lane
REPEAT = 5  # the lowest-rank rule named rank 0 in 15 of 20 runs on a 2-core machine; 5 runs take ~25 s


def _why(job) -> str:
    return f"rc {job.returncode}\n{job.output[-4000:]}\n--- workerlog.0\n{job.log(0)[-1500:]}"


def _assert_names_rank_1(job, code, reason):
    assert job.returncode == code, _why(job)
    assert (job.rank, job.code, job.reason) == (1, code, reason), _why(job)
    # after the root-cause line: the tail of rank 1's log
    after = job.output[job.output.index("paddle_hybrid.launch: root cause: rank 1"):]
    assert "dying_rank_script: rank 1 dies now" in after, _why(job)


def test_a_dying_rank_is_the_root_cause_not_its_collateral_peer(tmp_path):
    for run in range(REPEAT):
        work = tmp_path / f"run{run}"
        work.mkdir()
        job = root_cause_job.run(str(work), how="exit", exit_code=3)
        _assert_names_rank_1(job, 3, "no Python exception recorded")


def test_a_python_exception_is_the_root_cause_with_its_reason(tmp_path):
    job = root_cause_job.run(str(tmp_path), how="raise")
    _assert_names_rank_1(job, 1, "RuntimeError: boom")


def test_the_exit_watcher_leaves_reaping_to_popen():
    proc = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(0.3); os._exit(3)"])
    seen = []
    ec.watch_exit(proc, seen.append)
    started = time.time()
    while proc.poll() is None and time.time() - started < 10:  # as Paddle's launcher polls
        time.sleep(0.05)
    polled = time.time()
    assert proc.returncode == 3  # reaped by poll(), with its code
    deadline = time.time() + 5
    while not seen and time.time() < deadline:
        time.sleep(0.01)
    assert len(seen) == 1 and started < seen[0] <= polled + 0.05


def test_a_hung_rank_is_the_root_cause_with_its_stack_not_the_peer_that_timed_out(tmp_path):
    """Rank 1 sleeps for ever; rank 0's all_reduce times out at PADDLE_HYBRID_TIMEOUT=4 s naming
    rank 1.  The launcher names rank 1 (hung), exits with rank 0's code, and the log tail it
    shows has rank 1's Python stack at the function it hung in.  Seen failing first: rank 0,
    the peer, was named ("rank 0 exited with code 1 (GlooTimeoutError ...)")."""
    started = time.time()
    job = root_cause_job.run(str(tmp_path), how="hang", env={"PADDLE_HYBRID_TIMEOUT": "4"})
    assert job.returncode == 1, _why(job)
    assert (job.rank, job.code, job.hung) == (1, 1, True), _why(job)
    assert "still running when rank 0 timed out waiting for it" in job.reason, _why(job)
    after = job.output[job.output.index("paddle_hybrid.launch: root cause: rank 1 hung"):]
    assert "in _stuck_forever" in after, _why(job)  # faulthandler's line of the hung frame
    assert "also failed: rank 0 (code 1" in after and "waiting for rank 1" in after, _why(job)
    assert time.time() - started < 60, _why(job)


def test_the_launcher_looks_at_its_workers_every_50_ms_and_paddles_watch_comes_back():
    """Paddle's ``Pod.watch`` sleeps a second between looks (a job ends half a second late on
    average); inside ``root_cause_exit_code`` it looks every ``POLL_SECONDS``, and Paddle's own
    method is back afterwards."""
    from paddle.distributed.launch.job.pod import Pod

    from paddle_hybrid.launch.exit_code import POLL_SECONDS, root_cause_exit_code

    paddles = Pod.__dict__["watch"]
    with root_cause_exit_code():
        watch = Pod.__dict__["watch"]
        assert isinstance(watch, functools.partialmethod) and watch.func is paddles
        assert watch.keywords == {"interval": POLL_SECONDS} and POLL_SECONDS <= 0.05
    assert Pod.__dict__["watch"] is paddles
