"""The launcher's exit-code rule on Paddle's own ``Pod`` with fake workers (no processes):
the worker that failed first, on its own, gives the code, not a worker the launcher stopped nor
a peer that failed because of it; the worker side's failure record; the root-cause report."""
import itertools
import os
import sys
import time
import types
import warnings

import paddle
import pytest
from paddle.distributed.launch.job.pod import Pod
from paddle.distributed.launch.job.status import Status

from paddle_hybrid.launch import bootstrap
from paddle_hybrid.launch import exit_code as ec

_PIDS = itertools.count(4_000_000)  # above any real pid: no record or watcher can mix them up


class FakeContainer:
    """A worker: ``code`` None while running; ``send_signal``/``terminate`` end a running one
    with -15 as SIGTERM would.  Its process is held as Paddle's Container holds it
    (``_proc._proc.pid``), its global rank is in its environment, ``outfile`` is its log."""

    def __init__(self, code=None, outfile=None):
        self.code = code
        self.rank = None
        self.outfile = outfile
        self._proc = types.SimpleNamespace(_proc=types.SimpleNamespace(pid=next(_PIDS)))

    @property
    def pid(self):
        return self._proc._proc.pid

    @property
    def env(self):
        return {"PADDLE_TRAINER_ID": str(self.rank)}

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


# -- the root cause: first in time, not a collateral failure ------------------------------

T0 = 1_795_000_000.0  # some wall-clock time
RESET = ("RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:576] Read error "
         "[127.0.0.1]:8073: Connection reset by peer")
COLLATERAL = [
    RESET,
    "RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
    "[127.0.0.1]:21046",
    "RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
    "1800000ms for recv operation to complete",
    "RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:584] TIMEOUT self_rank = 0 "
    "pair_rank = 1 peer_str = [127.0.0.1]:42911",
]


def _record(launch, container, when, reason):
    bootstrap.write_record(launch.directory, pid=container.pid, rank=int(container.rank), when=when, reason=reason)


def test_earliest_failure_wins_over_the_lower_rank():
    with ec.root_cause_exit_code() as launch:
        pod = _pod(1, 7)
        _record(launch, pod.containers[0], T0 + 0.2, "ValueError: bad batch")
        _record(launch, pod.containers[1], T0, "SystemExit: 7")
        pod.stop(timeout=3)
        assert pod.exit_code == 7
        assert (launch.decision.rank, launch.decision.code, launch.decision.time) == (1, 7, T0)
        assert launch.decision.reason == "SystemExit: 7"


@pytest.mark.parametrize("reason", COLLATERAL)
@pytest.mark.parametrize("later", [0.020, 0.050, -0.030])
def test_a_collateral_failure_loses_to_the_root_failure(reason, later):
    """Rank 1 dies without Python (no record, only its exit time); rank 0's collective fails
    because of it a few ms later (or, within the clocks' slack, slightly "earlier")."""
    with ec.root_cause_exit_code() as launch:
        pod = _pod(1, 3)
        ec.note_exit(pod, pod.containers[1], T0)
        ec.note_exit(pod, pod.containers[0], T0 + later + 0.001)
        _record(launch, pod.containers[0], T0 + later, reason)
        pod.stop(timeout=3)
        assert pod.exit_code == 3
        assert launch.decision.rank == 1 and launch.decision.reason is None


def test_the_earliest_of_collateral_failures_when_there_is_nothing_else():
    with ec.root_cause_exit_code() as launch:
        pod = _pod(1, 1, None)
        _record(launch, pod.containers[0], T0 + 0.5, COLLATERAL[2])
        _record(launch, pod.containers[1], T0, COLLATERAL[3])
        pod.stop(timeout=3)
        assert pod.exit_code == 1 and launch.decision.rank == 1


@pytest.mark.parametrize("reason", COLLATERAL)
def test_collateral_reasons_are_recognised(reason):
    assert ec.is_collateral(reason)


@pytest.mark.parametrize("reason", [None, "RuntimeError: boom", "SystemExit: 7", "ValueError: Connection id 3"])
def test_other_reasons_are_not_collateral(reason):
    assert not ec.is_collateral(reason)


def test_no_record_at_all_falls_back_to_the_exit_times():
    with ec.root_cause_exit_code() as launch:
        pod = _pod(9, 3)
        ec.note_exit(pod, pod.containers[0], T0 + 0.01)
        ec.note_exit(pod, pod.containers[1], T0)
        pod.stop(timeout=3)
        assert pod.exit_code == 3
        assert launch.decision.rank == 1 and launch.decision.time == T0


def test_a_record_time_counts_before_the_exit_time_of_the_same_worker():
    """Rank 0 raised first but took long to exit (interpreter teardown): its record, not its
    exit, says when it failed."""
    with ec.root_cause_exit_code() as launch:
        pod = _pod(1, 3)
        _record(launch, pod.containers[0], T0, "ValueError: bad batch")
        ec.note_exit(pod, pod.containers[0], T0 + 0.5)
        ec.note_exit(pod, pod.containers[1], T0 + 0.1)
        pod.stop(timeout=3)
        assert pod.exit_code == 1 and launch.decision.rank == 0


def test_a_worker_stopped_by_the_launcher_is_never_the_root_cause():
    """Its record (its SIGTERM handler raised) comes after the stop: not a failure of its own."""
    with ec.root_cause_exit_code() as launch:
        pod = _pod(None, 3)
        ec.note_exit(pod, pod.containers[1], T0)
        pod.stop(timeout=3)
        pod.containers[0].code = 1
        bootstrap.write_record(launch.directory, pid=pod.containers[0].pid, rank=0, when=T0 + 1e9,
                               reason="KeyboardInterrupt")
        assert pod.exit_code == 3 and launch.decision.rank == 1


def test_paddles_rule_when_no_worker_failed_on_its_own():
    """Ctrl-C: both running at the stop; a record written while being stopped changes nothing,
    and nothing is reported."""
    with ec.root_cause_exit_code() as launch:
        pod = _pod(None, None)
        pod.stop(timeout=3)
        bootstrap.write_record(launch.directory, pid=pod.containers[1].pid, rank=1, when=T0 + 1e9,
                               reason="RuntimeError: interrupted")
        assert pod.exit_code == -15
        assert launch.decision is None


def test_the_launch_gives_workers_a_record_directory_and_removes_it():
    assert bootstrap.RECORD_DIR not in os.environ
    with ec.root_cause_exit_code() as launch:
        directory = launch.directory
        assert os.environ[bootstrap.RECORD_DIR] == directory and os.path.isdir(directory)
        bootstrap.write_record(directory, pid=1, rank=0, when=T0, reason="RuntimeError: boom")
    assert bootstrap.RECORD_DIR not in os.environ and not os.path.exists(directory)


def test_revert_restores_pod_and_environment_after_sys_exit():
    before = {name: Pod.__dict__[name] for name in ("stop", "deploy", "exit_code")}
    with pytest.raises(SystemExit):
        with ec.root_cause_exit_code() as launch:
            assert all(Pod.__dict__[name] is not before[name] for name in before)
            directory = launch.directory
            raise SystemExit(3)
    assert all(Pod.__dict__[name] is before[name] for name in before)
    assert bootstrap.RECORD_DIR not in os.environ and not os.path.exists(directory)


# -- what the user sees -------------------------------------------------------------------

def test_the_report_names_the_rank_its_code_and_shows_the_tail_of_its_log(tmp_path, capsys):
    log = tmp_path / "workerlog.1"
    log.write_text("".join(f"line {i}\n" for i in range(1, 51)))
    with pytest.raises(SystemExit) as exit_info:
        with ec.root_cause_exit_code() as launch:
            pod = Pod()
            pod.add_container(FakeContainer(1))
            pod.add_container(FakeContainer(3, outfile=str(log)))
            ec.note_exit(pod, pod.containers[1], T0)
            _record(launch, pod.containers[0], T0 + 0.02, RESET)
            pod.stop(timeout=3)
            sys.exit(pod.exit_code)  # as Paddle's launcher ends
    assert exit_info.value.code == 3
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if "root cause" in line)
    assert first.startswith("paddle_hybrid.launch: root cause: rank 1 exited with code 3 at ")
    assert first.endswith("(no Python exception recorded)")
    tail = err[err.index(first):]
    assert "line 21\n" in tail and "line 50\n" in tail and "line 20\n" not in tail
    assert "rank 0" in tail and "Connection reset by peer" in tail  # the consequence, named as such


def test_the_report_reads_only_this_launch_s_part_of_an_appended_log(tmp_path):
    log = tmp_path / "workerlog.0"
    log.write_text("old run\n" * 5 + "this run\n")
    cause = ec.RootCause(rank=0, code=1, time=T0, reason="RuntimeError: boom", log=str(log),
                         log_offset=len("old run\n") * 5)
    text = ec.format_root_cause(cause)
    assert "root cause: rank 0 exited with code 1 at " in text and "(RuntimeError: boom)" in text
    assert "this run" in text and "old run" not in text


def test_nothing_is_printed_on_success(capsys):
    with ec.root_cause_exit_code():
        pod = _pod(0, 0)
        assert pod.exit_code == 0
    assert "root cause" not in capsys.readouterr().err


# -- the worker side: the record ----------------------------------------------------------

def _run_bootstrap(tmp_path, monkeypatch, body):
    script = tmp_path / "script.py"
    script.write_text(body)
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv(bootstrap.RECORD_DIR, str(records))
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    monkeypatch.setattr(sys, "argv", ["bootstrap.py", str(script)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = time.time()
    try:
        bootstrap.main()
        raised = None
    except BaseException as exc:  # noqa: BLE001  (what the script ended with)
        raised = exc
    return raised, bootstrap.read_records(str(records)), before


def test_the_bootstrap_records_an_exception(tmp_path, monkeypatch):
    raised, records, before = _run_bootstrap(tmp_path, monkeypatch, 'raise RuntimeError("boom")\n')
    assert isinstance(raised, RuntimeError)  # the process still ends as without the bootstrap
    record = records[os.getpid()]
    assert record["rank"] == 1 and record["reason"] == "RuntimeError: boom"
    assert before <= record["time"] <= time.time()


@pytest.mark.parametrize("body, reason", [
    ("import sys\nsys.exit(7)\n", "SystemExit: 7"),
    ("import sys\nsys.exit('no data')\n", "SystemExit: no data"),
    ("import sys\nsys.exit(0)\n", None),
    ("import sys\nsys.exit()\n", None),
    ("x = 1\n", None),
])
def test_the_bootstrap_records_a_non_zero_sys_exit_only(tmp_path, monkeypatch, body, reason):
    raised, records, _ = _run_bootstrap(tmp_path, monkeypatch, body)
    if reason is None:
        assert records == {}
    else:
        assert isinstance(raised, SystemExit) and records[os.getpid()]["reason"] == reason


def test_one_line_reason_of_a_paddle_error():
    message = ("\n\n--------------------------------------\nC++ Traceback (most recent call last):\n"
               "--------------------------------------\n0   paddle::foo()\n\n----------------------\n"
               "Error Message Summary:\n----------------------\nInvalidArgumentError: shape mismatch "
               "(at /paddle/x.cc:1)\n")
    assert bootstrap.one_line_reason(ValueError(message)) == \
        "ValueError: InvalidArgumentError: shape mismatch (at /paddle/x.cc:1)"
    assert bootstrap.one_line_reason(RuntimeError("first\nsecond")) == "RuntimeError: first"
    assert bootstrap.one_line_reason(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert len(bootstrap.one_line_reason(RuntimeError("x" * 5000))) <= 300


def test_a_worker_stopped_while_exiting_after_its_own_failure_keeps_its_recorded_code():
    """Rank 0 raised (its record: code 1) and was still tearing down when the launcher's stop
    ended it with -15: the root cause is rank 0 with code 1, not -15 (was: -15, exit status 241)."""
    with ec.root_cause_exit_code() as launch:
        pod = _pod(None, None)
        bootstrap.write_record(launch.directory, pid=pod.containers[0].pid, rank=0, when=T0,
                               reason="AssertionError: loss is nan", code=1)
        pod.stop(timeout=3)
        assert pod.exit_code == 1
        assert (launch.decision.rank, launch.decision.code) == (0, 1)
        assert launch.decision.reason == "AssertionError: loss is nan"


@pytest.mark.parametrize("exc, status", [(RuntimeError("x"), 1), (SystemExit(7), 7), (SystemExit("msg"), 1),
                                         (SystemExit(None), 0), (KeyboardInterrupt(), None)])
def test_the_bootstrap_knows_the_status_an_exception_exits_with(exc, status):
    assert bootstrap.exit_status(exc) == status


def test_the_bootstrap_finds_the_ranks_a_wrapped_timeout_waited_for():
    """A script that wraps the plugin's timeout in its own error: the record still has the ranks."""
    class Timeout(RuntimeError):
        waited_for = [3]

    try:
        try:
            raise Timeout("gloo")
        except Timeout as inner:
            raise ValueError("step failed") from inner
    except ValueError as exc:
        assert bootstrap.waited_for(exc) == [3]
    assert bootstrap.waited_for(RuntimeError("x")) == []


def test_a_timeout_waiting_for_a_rank_still_running_names_that_rank_as_hung():
    """The rule without processes: rank 0 timed out waiting for rank 1, which was still running at
    the stop: rank 1 is the root cause (hung), with rank 0's code; not when rank 1 had ended."""
    waiting = ec.WorkerEnd(index=0, rank=0, code=1, own=True, record_time=T0, waited=[1],
                           reason="GlooTimeoutError: ... timed out after 5 s (PADDLE_HYBRID_TIMEOUT) waiting for rank 1")
    running = ec.WorkerEnd(index=1, rank=1, code=-15, own=False, log="workerlog.1")
    cause = ec.root_cause([waiting, running], hung={1: running})
    assert (cause.rank, cause.code, cause.hung, cause.log) == (1, 1, True, "workerlog.1")
    assert "still running when rank 0 timed out waiting for it" in cause.reason
    assert cause.also_failed == [waiting]
    assert "root cause: rank 1 hung; the job exits with code 1" in ec.format_root_cause(cause)
    plain = ec.root_cause([waiting, running], hung={})
    assert (plain.rank, plain.hung) == (0, False)
    # the ranks from the reason's words when the record has none
    assert ec.waited_for("x timed out after 2 s (S) waiting for ranks [2, 3]: no sign") == [2, 3]
