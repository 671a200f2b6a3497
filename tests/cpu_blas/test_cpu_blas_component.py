"""The ``cpu_blas`` component through the plugin's registry with the machine faked (vendor,
MKL version, which CPU type MKL reports after the variable is set), and once for real in a
fresh process on this machine."""
import json
import os
import subprocess
import sys
import warnings

import pytest

import paddle_hybrid
from paddle_hybrid import cpu_blas
from paddle_hybrid.cpu_blas import machine
from paddle_hybrid.cpu_blas.decision import VARIABLE, decide

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fake_machine(monkeypatch):
    """The component alone uninstalled and its process state reset; the machine answers from
    ``facts`` (edit it in the test); afterwards the real component is reinstalled."""
    paddle_hybrid.uninstall_component("cpu_blas")
    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setattr(cpu_blas, "_too_late", None)
    monkeypatch.setattr(cpu_blas, "_own_value", None)
    facts = {"cpu": ("AuthenticAMD", "/proc/cpuinfo", True), "version": ((2019, 0, 5), "fake/libmklml_intel.so"),
             "mapped": None, "cpu_type": lambda: int(os.environ.get(VARIABLE, "0"))}
    monkeypatch.setattr(machine, "read_cpu", lambda *a: facts["cpu"])
    monkeypatch.setattr(machine, "mkl_path", lambda env: ("fake/libmklml_intel.so", "fake/libmklml_intel.so"))
    monkeypatch.setattr(machine, "mkl_version", lambda path: facts["version"])
    monkeypatch.setattr(machine, "mapped_mkl", lambda: facts["mapped"])
    monkeypatch.setattr(machine, "mkl_cpu_type", lambda path: facts["cpu_type"]())
    yield facts
    paddle_hybrid.uninstall_component("cpu_blas")
    monkeypatch.undo()
    os.environ.pop(VARIABLE, None)
    cpu_blas._own_value = cpu_blas._too_late = None
    paddle_hybrid.install_component("cpu_blas", paddle_hybrid.current_config())


def _install(**config):
    return paddle_hybrid.install_component("cpu_blas", paddle_hybrid.PluginConfig(**config))


def _report_line():
    return next(l for l in paddle_hybrid.report().splitlines() if l.strip().startswith("cpu_blas"))


def test_amd_old_mkl_sets_it_and_uninstall_unsets_it(fake_machine):
    state = _install()
    assert state.status == "active", state.reason
    assert os.environ[VARIABLE] == "5"
    assert "CPU type 5" in _report_line() and "MKL 2019.0 Update 5" in _report_line()
    paddle_hybrid.uninstall_component("cpu_blas")
    assert VARIABLE not in os.environ


def test_too_late_warns_once_and_claims_nothing(fake_machine):
    fake_machine["mapped"] = "fake/libmklml_intel.so"
    fake_machine["cpu_type"] = lambda: 0  # MKL chose its generic kernels at an earlier BLAS call
    with pytest.warns(cpu_blas.CpuBlasWarning) as record:
        state = _install()
    assert len(record) == 1
    message = str(record[0].message)
    assert "python -m paddle_hybrid.launch" in message and VARIABLE in message
    assert state.status == "skipped" and "already chose" in state.reason
    assert VARIABLE not in os.environ  # taken back: it does nothing in this process
    assert "active" not in _report_line()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second install does not warn again
        state = _install()
    assert state.status == "off" and state.reason.startswith("too late")


def test_mkl_that_does_not_say_its_cpu_type(fake_machine):
    fake_machine["cpu_type"] = lambda: None
    assert "so it applies" in _install().reason  # not loaded before: no BLAS call can have run
    paddle_hybrid.uninstall_component("cpu_blas")
    fake_machine["mapped"] = "fake/libmklml_intel.so"
    state = _install()
    assert state.status == "active" and "unknown" in state.reason


@pytest.mark.parametrize("cpu, version, words", [
    (("GenuineIntel", "/proc/cpuinfo", True), ((2019, 0, 5), "x"), "Intel CPU"),
    ((None, "no /proc/cpuinfo on this OS", False), ((2019, 0, 5), "x"), "vendor unknown"),
    (("AuthenticAMD", "/proc/cpuinfo", True), ((2021, 4, 0), "x"), "ignores"),
    (("AuthenticAMD", "/proc/cpuinfo", True), (None, "undefined symbol: MKL_Get_Version"), "unknown"),
])
def test_cases_that_set_nothing(fake_machine, cpu, version, words):
    fake_machine["cpu"], fake_machine["version"] = cpu, version
    state = _install()
    assert state.status == "off" and words in state.reason
    assert VARIABLE not in os.environ
    assert words in _report_line()


def test_user_value_is_left_alone(fake_machine, monkeypatch):
    monkeypatch.setenv(VARIABLE, "2")
    state = _install()
    assert state.status == "off" and "left as it is" in state.reason
    assert os.environ[VARIABLE] == "2"
    assert cpu_blas.worker_environment(config=paddle_hybrid.PluginConfig()) == {}


def test_switch_off(fake_machine, monkeypatch):
    state = _install(cpu_blas=False)
    assert state.status == "off" and "cpu_blas=False" in state.reason
    assert VARIABLE not in os.environ
    assert cpu_blas.worker_environment(config=paddle_hybrid.PluginConfig(cpu_blas=False)) == {}
    monkeypatch.setenv("PADDLE_HYBRID_CPU_BLAS", "0")
    assert paddle_hybrid.PluginConfig.from_env().cpu_blas is False


def test_worker_environment_does_not_count_its_own_value_as_the_users(fake_machine):
    config = paddle_hybrid.PluginConfig()  # the default, whatever switch this test run was started with
    assert cpu_blas.worker_environment(config=config) == {VARIABLE: "5"}
    _install()
    assert os.environ[VARIABLE] == "5"
    assert cpu_blas.worker_environment(config=config) == {VARIABLE: "5"}
    line, reason = cpu_blas.shell_export(config=config)
    assert line == f"export {VARIABLE}=5\n" and "AMD" in reason


# -- this machine, fresh processes --------------------------------------------------------

def _fresh(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (VARIABLE, "PADDLE_HYBRID_CPU_BLAS")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_REPORT = """
import json, os, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    {before}
    import paddle_hybrid
from paddle_hybrid import cpu_blas
from paddle_hybrid.cpu_blas import machine
state = paddle_hybrid.catalog.install.component_state("cpu_blas")
path, _ = machine.mkl_path(os.environ)
print(json.dumps({{"env": os.environ.get("MKL_DEBUG_CPU_TYPE"), "status": state.status, "reason": state.reason,
                  "cpu_type": machine.mkl_cpu_type(path) if path else None,
                  "warnings": [str(w.message) for w in caught if w.category is cpu_blas.CpuBlasWarning]}}))
"""


def _real_decision():
    # the real facts, as a fresh process without the variable sees them
    return decide(machine.gather({k: v for k, v in os.environ.items() if k != VARIABLE}))


def test_this_machine_fresh_process():
    got = _fresh(_REPORT.format(before="pass"))
    decision = _real_decision()
    if decision.set_value:  # an AMD CPU with Paddle's MKL 2019/2020 (the machines of this project)
        assert got["status"] == "active" and got["env"] == "5", got
        assert got["cpu_type"] == 5, got  # MKL itself dispatches on the AVX2 type
        assert not got["warnings"]
    else:  # elsewhere: the documented reason, nothing set
        assert got["status"] == "off" and got["reason"] == decision.reason and got["env"] is None, got


def test_this_machine_blas_call_before_the_import():
    got = _fresh(_REPORT.format(before="import paddle; paddle.matmul(paddle.ones([4, 4]), paddle.ones([4, 4]))"))
    decision = _real_decision()
    if decision.set_value:
        assert got["status"] == "skipped" and got["env"] is None and got["cpu_type"] != 5, got
        assert len(got["warnings"]) == 1 and "python -m paddle_hybrid.launch" in got["warnings"][0]
    else:
        assert got["status"] == "off" and got["reason"] == decision.reason and not got["warnings"], got


def test_mkl_loads_its_libiomp5_first_when_paddle_has_not(monkeypatch, tmp_path):
    (tmp_path / "libiomp5.so").write_bytes(b"")
    calls = []

    def fake_cdll(path, mode=0):
        calls.append(os.path.basename(path))
        if calls == ["libmklml_intel.so"]:
            raise OSError("libiomp5.so: cannot open shared object file: No such file or directory")
        return object()

    monkeypatch.setattr(machine.ctypes, "CDLL", fake_cdll)
    machine._load(str(tmp_path / "libmklml_intel.so"))
    assert calls == ["libmklml_intel.so", "libiomp5.so", "libmklml_intel.so"]


def test_read_cpu_from_a_cpuinfo_file(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
                    "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n")
    assert machine.read_cpu(str(info)) == ("AuthenticAMD", str(info), True)
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx\n")
    assert machine.read_cpu(str(info))[0::2] == ("GenuineIntel", False)
    vendor, note, _ = machine.read_cpu(str(tmp_path / "missing"))
    assert vendor is None and "no " in note


def test_read_flags_from_a_cpuinfo_file(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f\n")
    assert machine.read_flags(str(info)) == frozenset({"fpu", "avx2", "avx512f"})
    assert machine.read_flags(str(tmp_path / "missing")) == frozenset()


def _cpu_blas_cli(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.cpu_blas", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


def test_this_machine_second_code_path_is_another_mkl_path():
    """``--alternate`` on this machine: where a second path is known, a fresh plugin process
    started with its environment dispatches MKL to other kernels than one started without it
    (``--which`` asks MKL itself); where none is known it says so and prints nothing."""
    base = {k: v for k, v in os.environ.items() if k not in ("MKL_ENABLE_INSTRUCTIONS", "PADDLE_HYBRID_CPU_BLAS")}
    lines, note = _cpu_blas_cli("--alternate", env=base)
    if not lines:
        assert "no second MKL code path" in note
        return
    alternate = dict(base)
    for line in lines.splitlines():
        verb, _, rest = line.partition(" ")
        if verb == "unset":
            alternate.pop(rest, None)
        else:
            key, _, value = rest.partition("=")
            alternate[key] = value
    default_type, _ = _cpu_blas_cli("--which", env=base)
    alternate_type, _ = _cpu_blas_cli("--which", env=alternate)
    assert default_type.startswith("CPU type") and alternate_type.startswith("CPU type"), (default_type, alternate_type)
    assert default_type != alternate_type, (default_type, alternate_type, lines)
