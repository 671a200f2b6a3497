"""``python -m paddle_hybrid.launch --max_restart N``: a job whose rank dies (an exit, a SIGKILL,
a SIGKILL in the middle of a checkpoint) restarts as a whole and finishes with the numbers of an
uninterrupted run, bitwise: the resumed steps redo the same arithmetic from the saved values
(``paddle_hybrid/testing/resume_script.py``, fleet DP2, AdamW).  Restarts run out with the failure's code; without an
explicit ``--max_restart`` nothing restarts (Paddle's default of 3 never did).  The loop's
pieces are tested without processes.
"""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from paddle_hybrid.launch import _parse_with_paddle
from paddle_hybrid.launch import restart

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "paddle_hybrid", "testing", "resume_script.py")
TIMEOUT = 300
STEPS = 8
# the launcher's restart loop and the checkpoint it resumes from (not Paddle's version): one CI lane, tests/conftest.py
pytestmark = pytest.mark.one_lane


def _run(tmp_path, name, *script_args, launcher_args=("--max_restart", "1"), deadline=60):
    """Run the job in ``tmp_path/name`` (``PADDLE_HYBRID_TIMEOUT=deadline``); returns (exit code,
    {rank: result}, stderr, log_dir)."""
    work = tmp_path / name
    out, ckpt, log_dir = work / "out", work / "ckpt", work / "log"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update({"PYTHONPATH": ROOT, "GLOG_minloglevel": "2", "OMP_NUM_THREADS": "1",
                "PADDLE_HYBRID_TIMEOUT": str(deadline)})
    cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "--log_dir", str(log_dir),
           *launcher_args, SCRIPT, "--out", str(out), "--ckpt", str(ckpt), "--steps", str(STEPS),
           *map(str, script_args)]
    proc = subprocess.run(cmd, env=env, cwd=str(work), capture_output=True, text=True, timeout=TIMEOUT)
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return proc.returncode, results, proc.stderr, log_dir


def _same_as_uninterrupted(got, want, msg):
    for rank in (0, 1):
        g, w = got[rank], want[rank]
        assert g["losses"], msg
        for step, loss in g["losses"].items():  # the resumed steps, each the uninterrupted run's
            assert loss == w["losses"][step], f"{msg} rank {rank} step {step}"
        for k in w["params"]:
            np.testing.assert_array_equal(g["params"][k], w["params"][k], err_msg=f"{msg} rank {rank} {k}")
        assert sorted(g["opt"]) == sorted(w["opt"]) and w["opt"], msg
        for k in w["opt"]:
            np.testing.assert_array_equal(g["opt"][k], w["opt"][k], err_msg=f"{msg} rank {rank} optimizer {k}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    code, results, err, _ = _run(tmp_path_factory.mktemp("restart"), "uninterrupted")
    assert code == 0, err[-3000:]
    assert sorted(results) == [0, 1] and all(r["attempt"] == 0 and r["start"] == 0 for r in results.values())
    return results


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_rank_that_dies_restarts_the_job_which_ends_as_if_uninterrupted(tmp_path, uninterrupted, how):
    die_at = random.Random().randint(3, STEPS - 1)  # after the checkpoint of step 2
    msg = f"rank 1 dies ({how}) at step {die_at}"
    code, results, err, log_dir = _run(tmp_path, "job", "--die-at", die_at, "--die-how", how)
    assert code == 0, f"{msg}\n{err[-4000:]}"
    assert "attempt 1 failed with code" in err and "restarting the job (restart 1 of 1" in err, err[-3000:]
    assert "root cause: rank 1 exited with code" in err, err[-3000:]  # the failed attempt's own report
    assert "the job finished after 1 restart" in err, err[-3000:]
    assert all(r["attempt"] == 1 for r in results.values()), msg
    assert {r["start"] for r in results.values()} == {die_at // 2 * 2}, msg  # the newest complete checkpoint
    assert (log_dir / "attempt_0" / "workerlog.1").exists(), sorted(p.name for p in log_dir.iterdir())
    _same_as_uninterrupted(results, uninterrupted, msg)


def test_a_hung_rank_is_named_with_its_stack_and_the_job_restarts(tmp_path, uninterrupted):
    """Rank 1 sleeps for ever at step 5 (first attempt); rank 0's gradient all_reduce times out at
    PADDLE_HYBRID_TIMEOUT=5 s naming it; the launcher names rank 1 as hung, with its stack, and
    the restarted job ends as if uninterrupted."""
    code, results, err, _ = _run(tmp_path, "job", "--die-at", 5, "--die-how", "hang", deadline=5)
    assert code == 0, err[-4000:]
    assert "root cause: rank 1 hung; the job exits with code 1" in err, err[-4000:]
    assert "in _stuck_forever" in err, err[-4000:]
    assert "restarting the job (restart 1 of 1" in err, err[-3000:]
    assert {r["start"] for r in results.values()} == {4}
    _same_as_uninterrupted(results, uninterrupted, "rank 1 hung at step 5")


def test_a_death_during_a_save_resumes_from_the_checkpoint_before(tmp_path, uninterrupted):
    """Rank 1 killed after writing its part of the checkpoint of step 6, before ``COMPLETE``:
    the restart skips that checkpoint and resumes from step 4."""
    code, results, err, _ = _run(tmp_path, "job", "--die-at", 6, "--die-how", "in-save")
    assert code == 0, err[-4000:]
    assert {r["start"] for r in results.values()} == {4}
    assert "skipping" in err or any("skipping" in p.read_text() for p in (tmp_path / "job" / "log").rglob("workerlog.*"))
    _same_as_uninterrupted(results, uninterrupted, "death in the save of step 6")


def test_restarts_run_out_with_the_failures_code(tmp_path):
    code, results, err, log_dir = _run(tmp_path, "job", "--die-at", 1, "--die-how", "exit", "--die-every-attempt")
    assert code == 3, err[-3000:]
    assert "attempt 2 failed with code 3" in err and "no restarts left (--max_restart 1), giving up" in err, err[-3000:]
    assert (log_dir / "attempt_0").is_dir() and (log_dir / "attempt_1").is_dir()
    assert not results


def test_without_max_restart_nothing_restarts(tmp_path):
    code, results, err, _ = _run(tmp_path, "job", "--die-at", 3, "--die-how", "exit", launcher_args=())
    assert code == 3, err[-3000:]
    assert "restarting" not in err and not results


# -- without processes ------------------------------------------------------------------

def _requested(argv, environ=None):
    full = [*argv, "train.py"]
    return restart.requested_restarts(argv, _parse_with_paddle(full), environ or {})


def test_only_an_explicit_max_restart_turns_the_loop_on():
    assert _requested(["--nproc_per_node", "2"]) is None  # Paddle's default of 3 is not a request
    assert _requested(["--max_restart", "2"]) == 2
    assert _requested(["--max_restart=0"]) == 0
    assert _requested([], {"PADDLE_MAX_RESTART": "4"}) == 4
    assert _requested(["--max_restart", "2"], {restart.ATTEMPT: "1"}) is None  # inside an attempt
    assert _requested(["--max_restart", "2", "--master", "etcd://127.0.0.1:2379"]) is None  # Paddle's elastic
    with pytest.raises(ValueError, match="must be 0 or more"):
        _requested(["--max_restart", "-1"])


def test_a_failed_attempts_logs_are_kept_and_older_files_left(tmp_path):
    old = tmp_path / "notes.txt"
    old.write_text("the user's")
    os.utime(old, (1, 1))
    (tmp_path / "workerlog.0").write_text("attempt 0")
    kept = restart.keep_attempt_logs(str(tmp_path), 0, since=100.0)
    assert kept == str(tmp_path / "attempt_0")
    assert (tmp_path / "attempt_0" / "workerlog.0").read_text() == "attempt 0"
    assert old.exists() and not (tmp_path / "workerlog.0").exists()
    assert restart.keep_attempt_logs(str(tmp_path), 1, since=100.0) is None


def test_the_loop_passes_the_attempt_and_stops_at_success(tmp_path):
    """A command that fails twice, then succeeds: three attempts, each told its number."""
    seen = tmp_path / "seen"
    code = (f"import os, sys; open({str(seen)!r}, 'a').write(os.environ['{restart.RESTART_COUNT}'] + "
            f"os.environ['{restart.MAX_RESTARTS}'] + ' '); sys.exit(0 if os.environ['{restart.RESTART_COUNT}'] == '2' "
            f"else 5)")
    lines = []
    rc = restart.run_attempts([sys.executable, "-c", code], 3, str(tmp_path / "log"), log=lines.append)
    assert rc == 0
    assert seen.read_text() == "03 13 23 "
    assert len(lines) == 3 and "restart 2 of 3" in lines[1] and "after 2 restarts" in lines[2], lines


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_restart_together(tmp_path, uninterrupted):
    """Two launchers, one worker each, meeting at a TCP ``--master`` on loopback (a second node
    simulated on this machine): the worker of one dies; each launcher restarts its own node, the
    two meet again at the master, and the job ends as if uninterrupted."""
    port = _free_port()
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update({"PYTHONPATH": ROOT, "GLOG_minloglevel": "2", "OMP_NUM_THREADS": "1", "PADDLE_HYBRID_TIMEOUT": "60"})
    procs = []
    for node in ("a", "b"):
        cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--master", f"127.0.0.1:{port}", "--nnodes", "2",
               "--nproc_per_node", "1", "--log_dir", str(tmp_path / f"log_{node}"), "--max_restart", "1", SCRIPT,
               "--out", str(out), "--ckpt", str(ckpt), "--steps", str(STEPS), "--die-at", "5", "--die-rank", "1"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
        assert "restarting the job (restart 1 of 1" in text and "the job finished after 1 restart" in text, text[-3000:]
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == [0, 1] and {r["start"] for r in results.values()} == {4}
    _same_as_uninterrupted(results, uninterrupted, "two nodes, rank 1 killed at step 5")
