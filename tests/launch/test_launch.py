"""``python -m paddle_hybrid.launch``: an unchanged fleet script (no ``import paddle_hybrid``)
trains PP2 on 2 CPU processes with the losses of one process; a failing rank's own exit code
reaches the caller (Paddle's launcher gives the -15 of a rank it stopped, see
``paddle_hybrid/launch/exit_code.py``); ``OMP_NUM_THREADS`` is the user's when set, else cores //
processes.  The argument rewriting is tested without processes.
"""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import paddle_hybrid
from paddle_hybrid import launch as ph_launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "plain_script.py")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "dygraph", "cpu"))
import pipeline_models as models  # noqa: E402
import plain_script  # noqa: E402

TIMEOUT = 240


def _launch(tmp_path, launcher, nprocs, *script_args, env=None):
    """Run ``python -m <launcher> --nproc_per_node N --log_dir ... plain_script.py ...``;
    returns (exit code, {rank: result}, log_dir)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    log_dir = tmp_path / "log"
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    run_env.update({"PYTHONPATH": ROOT, "GLOG_minloglevel": "2"})
    run_env.update(env or {})
    run_env = {k: v for k, v in run_env.items() if v is not None}
    cmd = [sys.executable, "-m", launcher, "--nproc_per_node", str(nprocs), "--log_dir", str(log_dir),
           SCRIPT, "--out", str(out), *map(str, script_args)]
    proc = subprocess.run(cmd, env=run_env, cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return proc.returncode, results, log_dir, proc


def _logs(log_dir) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(log_dir.glob("workerlog.*")))


# -- without processes ------------------------------------------------------------------

def _args(argv):
    return ph_launch._parse_with_paddle(argv)


def test_worker_argv_puts_the_bootstrap_before_the_script_only():
    argv = ["--nproc_per_node", "2", "--log_dir", "logs", "train.py", "--nproc_per_node", "5", "--lr", "0.1"]
    got = ph_launch.worker_argv(argv, _args(argv))
    assert got == ["--nproc_per_node", "2", "--log_dir", "logs", ph_launch.BOOTSTRAP, "train.py",
                   "--nproc_per_node", "5", "--lr", "0.1"]
    # Paddle's parser, run on the rewritten arguments, sees the bootstrap as the script and the
    # user's script with its arguments as the script's arguments.
    again = _args(got)
    assert again.training_script == ph_launch.BOOTSTRAP
    assert again.training_script_args == ["train.py", "--nproc_per_node", "5", "--lr", "0.1"]
    assert again.nproc_per_node == 2 and again.log_dir == "logs"


def test_worker_argv_leaves_a_program_alone_and_says_so():
    argv = ["--nproc_per_node", "2", "run.sh", "--x"]
    with pytest.warns(RuntimeWarning, match="not a .py file"):
        assert ph_launch.worker_argv(argv, _args(argv)) == argv


def test_processes_per_node_follows_paddles_rule():
    assert ph_launch.processes_per_node(_args(["--nproc_per_node", "3", "t.py"]), {}) == 3
    assert ph_launch.processes_per_node(_args(["--devices", "0,1,2,3", "t.py"]), {}) == 4
    assert ph_launch.processes_per_node(_args(["--nproc_per_node", "3", "t.py"]), {"PADDLE_NPROC_PER_NODE": "5"}) == 5
    assert ph_launch.processes_per_node(_args(["t.py"]), {}) == 1  # CPU build: one device


def test_omp_threads_is_cores_over_processes_at_least_one():
    assert ph_launch.omp_threads(8, 2) == 4
    assert ph_launch.omp_threads(2, 2) == 1
    assert ph_launch.omp_threads(2, 8) == 1
    assert ph_launch.omp_threads(7, 2) == 3


def test_launch_environment_keeps_a_user_value():
    args = _args(["--nproc_per_node", "2", "t.py"])
    assert ph_launch.launch_environment(args, {"OMP_NUM_THREADS": "3"}).get("OMP_NUM_THREADS") is None
    assert ph_launch.launch_environment(args, {})["OMP_NUM_THREADS"] == str(max(1, ph_launch.usable_cores() // 2))


# -- with processes -----------------------------------------------------------------------

@pytest.mark.parametrize("argv0, orig_argv, launcher", [
    ("-m", ["python", "-m", "paddle_hybrid.launch", "--nproc_per_node", "2", "train.py"], True),
    ("-m", ["python", "-X", "importtime", "-m", "paddle_hybrid.launch", "train.py"], True),
    ("-m", ["python", "-m", "mypackage.train"], False),  # a user's module importing the plugin
    ("/x/paddle_hybrid/launch/__main__.py", ["python", "-m", "paddle_hybrid.launch", "train.py"], False),
    ("train.py", ["python", "train.py"], False),
])
def test_only_the_launchers_own_process_skips_the_install(monkeypatch, argv0, orig_argv, launcher):
    monkeypatch.setattr(sys, "argv", [argv0])
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert paddle_hybrid._is_the_launcher_process() is launcher


def test_a_module_run_with_dash_m_that_imports_the_plugin_installs_it(tmp_path):
    (tmp_path / "uses_plugin.py").write_text("import paddle_hybrid\nprint(len(paddle_hybrid.installed_components()))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "uses_plugin"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0


def test_unchanged_script_trains_pp2_like_one_process(tmp_path):
    steps = 3
    code, results, log_dir, proc = _launch(tmp_path, "paddle_hybrid.launch", 2, "--mode", "train", "--pp", 2,
                                           "--steps", steps, env={"OMP_NUM_THREADS": "1"})
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _logs(log_dir)
    assert sorted(results) == [0, 1]
    specs = models.block_specs(plain_script.SPECS["num_layers"], plain_script.SPECS["in_dim"],
                               plain_script.SPECS["hidden"], plain_script.SPECS["out_dim"])
    ref, _ = models.reference_run(specs, plain_script.SEED, steps, plain_script.MICRO * plain_script.ACC,
                                  plain_script.MICRO, plain_script.LR, plain_script.SPECS["in_dim"],
                                  plain_script.SPECS["out_dim"], 1, 0)
    for rank, r in results.items():
        # the plugin was there before the script's first line; the script ran as under plain python
        assert r["plugin_before_first_line"] is True, rank
        assert r["name"] == "__main__" and r["file"] == SCRIPT and r["argv"][0] == SCRIPT
        assert r["argv"][1:4] == ["--out", str(tmp_path / "out"), "--mode"]
        assert r["path0"] == HERE
        # the pipeline and the one-process reference (pipeline_models.reference_run, SGD) sum the
        # microbatch gradients in another float32 order; 1e-5 as in tests/dygraph/cpu's layouts
        np.testing.assert_allclose(r["losses"], ref, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")
    assert (log_dir / "workerlog.0").exists() and (log_dir / "workerlog.1").exists()


def test_stock_launcher_cannot_train_the_unchanged_script_on_cpu(tmp_path):
    """Why the command exists: Paddle's launcher alone fails on the same script."""
    code, results, log_dir, _ = _launch(tmp_path, "paddle.distributed.launch", 2, "--mode", "train",
                                        "--steps", 1, env={"OMP_NUM_THREADS": "1"})
    assert code != 0 and len(results) < 2
    assert "_device_id" in _logs(log_dir)


# The other rank is still running (it waits HOLD s) when the launcher sees rank 1 fail, so the
# launcher stops it with SIGTERM.  Paddle's launcher then exits with the stopped rank 0's -15
# (241); ours with rank 1's own code.
HOLD = 60
SIGTERM_EXIT = -15 & 0xFF


def test_failing_rank_exception_gives_exit_code_1_where_paddles_launcher_gives_the_stopped_rank(tmp_path):
    codes = {}
    for launcher in ("paddle.distributed.launch", "paddle_hybrid.launch"):
        run_dir = tmp_path / launcher
        run_dir.mkdir()
        code, results, log_dir, _ = _launch(run_dir, launcher, 2, "--mode", "fail", "--fail-rank", 1,
                                            "--hold", HOLD, env={"OMP_NUM_THREADS": "1"})
        codes[launcher] = code
        assert results == {}, launcher  # rank 1 failed, rank 0 was stopped while it waited
        assert "fails on purpose" in _logs(log_dir), launcher
    assert codes == {"paddle.distributed.launch": SIGTERM_EXIT, "paddle_hybrid.launch": 1}


def test_exit_code_of_the_script_reaches_the_caller(tmp_path):
    code, results, log_dir, _ = _launch(tmp_path, "paddle_hybrid.launch", 2, "--mode", "fail", "--fail-rank", 1,
                                        "--exit-code", 7, "--hold", HOLD, env={"OMP_NUM_THREADS": "1"})
    assert code == 7, _logs(log_dir)
    assert results == {}


def test_exit_code_without_hold(tmp_path):
    """No hold: rank 0 may have finished or still be running when rank 1 fails; 7 either way."""
    code, results, log_dir, _ = _launch(tmp_path, "paddle_hybrid.launch", 2, "--mode", "fail", "--fail-rank", 1,
                                        "--exit-code", 7, env={"OMP_NUM_THREADS": "1"})
    assert code == 7, _logs(log_dir)


def test_omp_num_threads_user_value_is_kept(tmp_path):
    code, results, log_dir, _ = _launch(tmp_path, "paddle_hybrid.launch", 2, "--mode", "env",
                                        env={"OMP_NUM_THREADS": "3"})
    assert code == 0, _logs(log_dir)
    assert [results[r]["omp"] for r in (0, 1)] == ["3", "3"]


def test_omp_num_threads_default_is_cores_over_processes(tmp_path):
    code, results, log_dir, _ = _launch(tmp_path, "paddle_hybrid.launch", 1, "--mode", "env",
                                        env={"OMP_NUM_THREADS": None})
    assert code == 0, _logs(log_dir)
    assert results[0]["omp"] == str(ph_launch.usable_cores())


def test_workers_get_the_cpu_blas_setting_from_their_start(tmp_path):
    from paddle_hybrid import cpu_blas

    env = {k: v for k, v in os.environ.items() if k != cpu_blas.VARIABLE}
    # the decision with the switch as this run has it (PADDLE_HYBRID_CPU_BLAS=0 on MKL's second
    # code path on AMD: nothing set)
    expected = cpu_blas.worker_environment(env, config=paddle_hybrid.PluginConfig.from_env()).get(cpu_blas.VARIABLE)
    code, results, log_dir, _ = _launch(tmp_path, "paddle_hybrid.launch", 2, "--mode", "env",
                                        env={"OMP_NUM_THREADS": "1", cpu_blas.VARIABLE: None})
    assert code == 0, _logs(log_dir)
    for r in results.values():
        assert r["mkl_env"] == expected
        if expected:  # set by the launcher, so the worker's plugin found it already there
            assert r["cpu_blas"][0] == "off" and "was set before the plugin" in r["cpu_blas"][1]


def test_user_cpu_blas_value_reaches_the_workers_unchanged(tmp_path):
    code, results, log_dir, _ = _launch(tmp_path, "paddle_hybrid.launch", 1, "--mode", "env",
                                        env={"OMP_NUM_THREADS": "1", "MKL_DEBUG_CPU_TYPE": "2"})
    assert code == 0, _logs(log_dir)
    assert results[0]["mkl_env"] == "2"
