"""The launcher's exit-code rule on Paddle's own ``Pod`` with fake workers (no processes):
the first worker that failed on its own gives the code, not a worker the launcher stopped."""
import warnings

import paddle
import pytest
from paddle.distributed.launch.job.pod import Pod
from paddle.distributed.launch.job.status import Status

from paddle_hybrid.launch import exit_code as ec


class FakeContainer:
    """A worker: ``code`` None while running; ``send_signal``/``terminate`` end a running one
    with -15 as SIGTERM would."""

    def __init__(self, code=None):
        self.code = code
        self.rank = None

    @property
    def exit_code(self):
        return self.code

    @property
    def status(self):  # as Paddle's Container reads its process
        if self.code is None:
            return Status.RUNNING
        return Status.COMPLETED if self.code == 0 else Status.FAILED

    def send_signal(self, sig):
        if self.code is None:
            self.code = -sig

    def terminate(self, force=False):
        self.send_signal(15)

    def start(self):
        self.code = None

    def wait(self, timeout=None):
        return self.code is not None


def _pod(*codes):
    pod = Pod()
    for code in codes:
        pod.add_container(FakeContainer(code))
    return pod


def test_paddles_rule_reports_the_stopped_rank():
    """What the CI failure was: rank 0 still running, rank 1 exited 7, the pod is stopped."""
    pod = _pod(None, 7)
    pod.stop(timeout=3)
    assert pod.exit_code == -15


def test_own_failure_wins_over_the_stopped_rank():
    with ec.root_cause_exit_code():
        pod = _pod(None, 7)
        pod.stop(timeout=3)
        assert [c.code for c in pod.containers] == [-15, 7]
        assert pod.exit_code == 7


def test_a_worker_killed_by_sighup_on_its_own_counts():
    """-1 is also what Popen reports for SIGHUP; only Paddle's status says who failed."""
    with ec.root_cause_exit_code():
        pod = _pod(None, -1)
        pod.stop(timeout=3)
        assert pod.exit_code == -1


def test_lowest_rank_among_own_failures_and_later_stops_do_not_overwrite():
    with ec.root_cause_exit_code():
        pod = _pod(None, 3, 9)
        pod.stop(timeout=3)
        pod.stop(timeout=30)  # the controller's stop at the end sees only stopped workers
        assert pod.exit_code == 3


def test_no_own_failure_keeps_paddles_rule():
    """Ctrl-C: every worker was running when the pod was stopped."""
    with ec.root_cause_exit_code():
        pod = _pod(None, None)
        pod.stop(timeout=3)
        assert pod.exit_code == -15
        done = _pod(0, 0)
        assert done.exit_code == 0


def test_a_new_deploy_forgets_the_record():
    with ec.root_cause_exit_code():
        pod = _pod(None, 7)
        pod.stop(timeout=3)
        pod.deploy()  # an elastic restart: every worker running again
        pod.containers[0].code = 5
        pod.stop(timeout=3)
        assert pod.exit_code == 5


def test_pod_is_paddles_again_after_the_launch():
    before = {name: Pod.__dict__[name] for name in ("stop", "deploy", "exit_code")}
    with ec.root_cause_exit_code():
        assert all(Pod.__dict__[name] is not before[name] for name in before)
    assert all(Pod.__dict__[name] is before[name] for name in before)


def test_pod_is_paddles_again_after_sys_exit():
    before = Pod.__dict__["exit_code"]
    with pytest.raises(SystemExit):
        with ec.root_cause_exit_code():
            raise SystemExit(7)
    assert Pod.__dict__["exit_code"] is before


def test_unverified_paddle_warns_and_keeps_paddles_rule(monkeypatch):
    monkeypatch.setattr(paddle, "__version__", "9.0.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ec.root_cause_exit_code():
            pod = _pod(None, 7)
            pod.stop(timeout=3)
            assert pod.exit_code == -15
    assert any("9.0.0" in str(w.message) and "exit-code rule" in str(w.message) for w in caught)
