"""Workers that import Paddle while the launcher does (``paddle_hybrid.launch.warm_start``): a
worker handed to a waiting process sees what a worker started as before sees (arguments,
``sys.path[0]``, directory, environment but the job's ports, the log files, its parent), its failure
reaches the caller with its own code; a waiting process is not used where Paddle would read a
variable at import that differs, nor for another command; and the rule's pieces without processes."""
import os
import subprocess
import sys

import pytest

from paddle_hybrid.launch import bootstrap, warm_start

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "plain_script.py")
TIMEOUT = 240
# what differs between two launches of one job whatever the start (ports, names, temporary paths),
# and the switch and the mark themselves
PER_LAUNCH = ("PADDLE_MASTER", "PADDLE_CURRENT_ENDPOINT", "PADDLE_TRAINER_ENDPOINTS", "POD_NAME",
              "PADDLE_HYBRID_LAUNCH_RECORDS", "PADDLE_HYBRID_WARM_START", warm_start.STARTED_VARIABLE)


def _launch(tmp_path, name, *script_args, warm=True):
    out, log_dir = tmp_path / name, tmp_path / f"{name}.log"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PADDLE_HYBRID_WARM_START": "1" if warm else "0"})
    cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "--log_dir", str(log_dir), SCRIPT,
           "--out", str(out), *map(str, script_args)]
    launcher = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    output, _ = launcher.communicate(timeout=TIMEOUT)
    import json

    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    logs = {r: (log_dir / f"workerlog.{r}").read_text(errors="replace") for r in (0, 1)}
    return launcher, output, results, logs


def test_a_warm_worker_sees_what_a_cold_one_sees(tmp_path):
    warm, _, warm_results, warm_logs = _launch(tmp_path, "warm", "--mode", "env")
    cold, _, cold_results, _ = _launch(tmp_path, "cold", "--mode", "env", warm=False)
    assert warm.returncode == 0 and cold.returncode == 0
    for rank in (0, 1):
        w, c = warm_results[rank], cold_results[rank]
        assert w["environ"].get(warm_start.STARTED_VARIABLE) == "1"
        assert warm_start.STARTED_VARIABLE not in c["environ"]
        assert w["paddle_before_first_line"] and w["plugin_before_first_line"]
        assert w["ppid"] == warm.pid and c["ppid"] == cold.pid  # a child of the launcher
        for key in ("name", "path0", "omp", "file", "mkl_env", "cwd"):
            assert w[key] == c[key], key
        assert w["argv"] == [SCRIPT, "--out", str(tmp_path / "warm"), "--mode", "env"]
        assert c["argv"] == [SCRIPT, "--out", str(tmp_path / "cold"), "--mode", "env"]
        # the environment: equal but for what every launch of a job makes anew
        differ = sorted(k for k in set(w["environ"]) | set(c["environ"])
                        if w["environ"].get(k) != c["environ"].get(k) and k not in PER_LAUNCH
                        and not w["environ"].get(k, "").startswith(str(tmp_path)))
        assert differ == [], differ
        assert f"plain_script: rank {rank} to stdout (warm: 1)" in warm_logs[rank]
        assert f"plain_script: rank {rank} to stderr" in warm_logs[rank]


def test_a_warm_workers_exit_code_and_root_cause_reach_the_caller(tmp_path):
    launcher, output, _, logs = _launch(tmp_path, "fail", "--mode", "fail", "--fail-rank", 1, "--exit-code", 7,
                                        "--hold", 2)
    assert launcher.returncode == 7, output
    assert "root cause: rank 1 exited with code 7" in output, output
    assert "plain_script: rank 1 to stdout (warm: 1)" in logs[1], logs[1]


# -- the pool in this process ----------------------------------------------------------------

@pytest.fixture
def pool_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    return env


def _worker_env(pool, extra):
    """What Paddle's launcher would give: the waiting process's environment after its import of
    Paddle, and the rank's variables."""
    waiting = pool.waiting[0]
    assert waiting.ready(pool.ready_timeout)
    return {**waiting.environ, "PADDLE_TRAINER_ID": "0", "PADDLE_LOG_DIR": "x", **extra}


def test_a_waiting_process_runs_the_bootstrap_command_handed_to_it(tmp_path, pool_env):
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint('job', os.environ['PADDLE_TRAINER_ID'], sys.argv[1:], os.getcwd())\n"
                      "print('to stderr', file=sys.stderr)\nsys.exit(5)\n")
    pool = warm_start.WarmPool(1, pool_env, 120.0)
    try:
        with open(tmp_path / "out.log", "w") as out:
            process = pool.take([sys.executable, "-u", warm_start.BOOTSTRAP, str(script), "--x", "1"],
                                _worker_env(pool, {}), out, out, preexec_fn=os.setsid)
            assert process is not None
            assert process.wait(timeout=120) == 5
    finally:
        pool.close()
    text = (tmp_path / "out.log").read_text()
    assert f"job 0 ['--x', '1'] {os.getcwd()}" in text and "to stderr" in text, text


def test_a_waiting_process_whose_launcher_is_gone_exits_by_itself(pool_env):
    """The launcher killed (its end of the socket closed, no stop): the waiting process must not
    stay behind."""
    pool = warm_start.WarmPool(1, pool_env, 120.0)
    waiting = pool.waiting.pop()
    try:
        waiting.sock.close()  # what the launcher's death does to its end
        assert waiting.process.wait(timeout=60) == 0
    finally:
        if waiting.process.poll() is None:
            waiting.process.kill()


@pytest.mark.parametrize("extra, cmd_tail", [
    ({"FLAGS_check_nan_inf": "1"}, None),       # Paddle reads FLAGS_* when it is imported
    ({"OMP_NUM_THREADS": "2"}, None),
    ({"PADDLE_P2P_SYNC_SEND": "1"}, None),      # a PADDLE_ variable Paddle reads at import
    ({}, ["run.sh"]),                           # not the bootstrap: a program
])
def test_a_waiting_process_is_not_used_where_it_would_differ(tmp_path, pool_env, extra, cmd_tail):
    pool = warm_start.WarmPool(1, pool_env, 120.0)
    process = pool.waiting[0].process
    try:
        cmd = [sys.executable, "-u", *(cmd_tail or [warm_start.BOOTSTRAP, "job.py"])]
        assert pool.take(cmd, _worker_env(pool, extra), None, None, preexec_fn=os.setsid) is None
        assert process.wait(timeout=30) is not None and pool.waiting == []  # stopped, not left waiting
    finally:
        pool.close()


def test_the_rule_without_processes():
    assert warm_start.may_differ("PADDLE_TRAINER_ID") and warm_start.may_differ("POD_IP")
    assert not warm_start.may_differ("PADDLE_P2P_SYNC_SEND") and not warm_start.may_differ("FLAGS_x")
    base = {"PATH": "/bin", "FLAGS_a": "1"}
    assert warm_start.incompatible({**base, "PADDLE_TRAINER_ID": "1"}, base) == []
    assert warm_start.incompatible({**base, "FLAGS_a": "2"}, base) == ["FLAGS_a"]
    assert warm_start.incompatible({"PATH": "/bin"}, base) == ["FLAGS_a"]
    env = {}
    assert warm_start.early_worker_count(["--nproc_per_node", "2", "t.py"], env) == 2
    assert warm_start.early_worker_count(["--nproc_per_node=3", "t.py", "--nproc_per_node", "9"], env) == 3
    assert warm_start.early_worker_count(["t.py", "--nproc_per_node", "2"], env) is None  # the script's
    assert warm_start.early_worker_count(["--nproc_per_node", "2", "--max_restart", "1", "t.py"], env) is None
    assert warm_start.early_worker_count(["--nnodes", "2", "--nproc_per_node", "2", "t.py"], env) is None
    assert warm_start.early_worker_count(["t.py"], {"PADDLE_NPROC_PER_NODE": "4"}) == 4
    assert bootstrap.STARTED_VARIABLE == warm_start.STARTED_VARIABLE
    assert warm_start.cpu_wheel()  # the wheel these tests run on: the warm start's only build
