"""The build: library location, the ImportError when it is missing, and the
CUDA kernels compiled with nvcc where nvcc is on PATH."""
import os
import shutil
import subprocess
import sys

import pytest

from paddle_hybrid import ops


def test_library_loaded_from_package():
    assert os.path.exists(ops.library_path())
    assert os.path.dirname(ops.library_path()) == os.path.dirname(os.path.abspath(ops.__file__))


def test_missing_library_gives_build_instructions(tmp_path, repo_root):
    pkg = tmp_path / "paddle_hybrid"
    shutil.copytree(os.path.join(repo_root, "paddle_hybrid"), pkg,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = "import paddle_hybrid"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr
    assert ops.BUILD_COMMAND in proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: the CUDA kernels cannot be compiled here")
def test_cuda_kernels_compile_with_nvcc(tmp_path, repo_root):
    src = os.path.join(repo_root, "custom_ops", "coalesce_tensor.cu")
    obj = tmp_path / "coalesce_tensor.o"
    cmd = ["nvcc", "-std=c++17", "-O2", "-c", src, "-o", str(obj), "-I", os.path.join(repo_root, "custom_ops"),
           "-Xcompiler", "-fPIC"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    syms = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True).stdout
    assert "paddle_hybrid::CudaCopyBytes" in syms and "paddle_hybrid::CudaFillPattern" in syms


@pytest.mark.skipif(os.environ.get("PADDLE_HYBRID_TEST_PACKAGING") == "0",
                    reason="PADDLE_HYBRID_TEST_PACKAGING=0: CI builds the wheel in its other lane (.ci/run)")
def test_non_editable_install_builds_and_loads(tmp_path, repo_root):
    """`pip install .` path: build a wheel, install it into a fresh target dir,
    import it from there (not from the source tree) and run both ops.  (CI runs it in one of its
    two lanes, the one with time to spare: the packaging does not depend on Paddle's version, and
    each lane builds the ops against its own Paddle at set-up.)"""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                            repo_root, "-w", str(wheel_dir)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = list(wheel_dir.glob("paddle_hybrid-*.whl"))
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    code = ("import paddle, paddle_hybrid; from paddle_hybrid import ops;"
            "x = paddle.ones([3]); o, f = ops.coalesce_tensor([x], copy_data=True);"
            "assert ops.nop(x) is x and float(f.sum()) == 3.0;"
            "print(paddle_hybrid.__file__)")
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith(str(target))


# Runs setup.py as pip's build backend does (setup.py <command>) with `wheel`
# unimportable: a meta-path finder refuses it, as in a new venv that has Paddle
# and setuptools < 70.1 but no `wheel`.
_SETUP_WITHOUT_WHEEL = r"""
import runpy, sys
class NoWheel:
    def find_spec(self, name, path=None, target=None):
        if name == "wheel" or name.startswith("wheel."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoWheel())
sys.argv = ["setup.py"] + sys.argv[1:]
runpy.run_path("setup.py", run_name="__main__")
"""


@pytest.mark.parametrize("command", ["dist_info", "bdist_wheel", "editable_wheel"])
def test_install_without_wheel_says_what_to_install(tmp_path, repo_root, command):
    """`pip install --no-build-isolation .` in a venv without `wheel` stops in
    setup.py (pip's first call is dist_info) with the command that fixes it,
    not with setuptools' "invalid command 'bdist_wheel'"."""
    args = [command] + (["--output-dir", str(tmp_path)] if command in ("dist_info", "editable_wheel")
                        else ["--dist-dir", str(tmp_path)])
    proc = subprocess.run([sys.executable, "-c", _SETUP_WITHOUT_WHEEL, *args], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pip install wheel" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # stopped before building anything


def _env_without_ccache():
    """This environment with no ccache on PATH (Paddle looks there and with ``which``) and Python's
    default warning filters."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "ccache"))]
    env = dict(os.environ, PATH=os.pathsep.join(path))
    env.pop("PYTHONWARNINGS", None)
    return env


def test_import_prints_no_ccache_warning(repo_root):
    """``import paddle`` imports Paddle's cpp_extension package, which warns "No ccache found" (a
    compiler cache, for builds); the plugin builds nothing at import, so its first import of Paddle
    (``paddle_hybrid/ops.py``) silences that warning.  The first run shows that this environment
    gets the warning from Paddle itself."""
    env = _env_without_ccache()
    paddle_alone = subprocess.run([sys.executable, "-c", "import paddle.utils.cpp_extension"], cwd=repo_root, env=env,
                                  capture_output=True, text=True, timeout=120)
    assert "No ccache found" in paddle_alone.stderr, paddle_alone.stderr[-2000:]
    code = "import paddle_hybrid\nfrom paddle_hybrid import ops\nassert ops.NOP_OP in ops.REGISTERED_OPS"
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ccache" not in proc.stderr, proc.stderr[-3000:]
