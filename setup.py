"""Build and install paddle_hybrid.

The custom ops in ``custom_ops/`` are compiled with Paddle's own custom-op
toolchain (``paddle.utils.cpp_extension``): CPU kernels always, CUDA kernels
when the installed Paddle is compiled with CUDA.  Paddle must therefore be
importable while building, so install with::

    pip install --no-build-isolation .        # or -e . for an editable install

The shared library lands at ``paddle_hybrid/_custom_ops.so`` and is loaded once
by ``paddle_hybrid.ops``.  A second, small extension, ``paddle_hybrid/_prefix_store.so``
(``custom_ops/prefix_store.cc``, loaded by ``paddle_hybrid.gloo.prefix_store``), is a
Python module built against Paddle's pybind11 with libpaddle's pybind11 internals id, so the
stores it makes pass to Paddle as Paddle's own ``Store``.  Every build compiles from scratch (``force``): the
library belongs to the Paddle it was compiled against, and setuptools' "up to
date" check only compares source and library times, so after a change of
Paddle it would copy the old library back.

``pip install .`` builds a wheel, which with setuptools older than 70.1 (a
Python 3.11 venv brings 65.5) needs the ``wheel`` package; :func:`check_wheel`
stops early with that instruction instead of setuptools' "invalid command
'bdist_wheel'".
"""
import os
import sys

from setuptools import find_packages, setup

# The commands pip runs for `pip install .` / `pip install -e .` / `pip wheel .`
# (PEP 517 metadata and build hooks); each needs a bdist_wheel command.
WHEEL_COMMANDS = ("bdist_wheel", "dist_info", "editable_wheel")
WHEEL_MISSING = (
    "paddle_hybrid: installing with pip builds a wheel, and this Python has no "
    "bdist_wheel command (the `wheel` package is not installed; setuptools would "
    "say \"invalid command 'bdist_wheel'\"). Install it first:\n"
    "    pip install wheel\n"
    "then run the install again: pip install --no-build-isolation ."
)


def check_wheel(argv=None):
    """Stop with an instruction when a wheel is to be built without `wheel`."""
    argv = sys.argv[1:] if argv is None else argv
    if not any(cmd in argv for cmd in WHEEL_COMMANDS):
        return
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return
    except ImportError:
        pass
    try:
        import wheel.bdist_wheel  # noqa: F401
    except ImportError:
        raise SystemExit(WHEEL_MISSING) from None


check_wheel()

try:
    import paddle
    from paddle.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - exercised by users only
    raise SystemExit(
        "paddle_hybrid: building the custom ops needs Paddle importable in this "
        "Python (pip install paddlepaddle==3.3.1, or a GPU build), and pip's "
        "build isolation off: pip install --no-build-isolation ."
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))
OPS_DIR = os.path.join("custom_ops")
CPU_SOURCES = [os.path.join(OPS_DIR, f) for f in ("nop.cc", "coalesce_tensor.cc", "uncoalesce_tensor.cc",
                                                  "gloo_kernels.cc", "comm_rings.cc", "local_ring.cc",
                                                  "fake_comm.cc", "unbacked.cc", "moe_cpu_kernels.cc")]
CUDA_SOURCES = [os.path.join(OPS_DIR, "coalesce_tensor.cu")]
WITH_CUDA = paddle.is_compiled_with_cuda() and os.environ.get("PADDLE_HYBRID_NO_CUDA", "0") != "1"


class BuildOps(BuildExtension):
    """Paddle's BuildExtension (compiler flags, nvcc) without its egg-era
    extras: no generated Python stub and no ``*_pd_.so`` renaming, because
    ``paddle_hybrid.ops`` loads the library itself."""

    def run(self):
        from setuptools.command.build_ext import build_ext

        build_ext.run(self)

    def _record_op_info(self):
        # Paddle records op names for the stub skipped above, and allows one extension per
        # build there; this build has two (the ops and the prefix store).
        pass

    def finalize_options(self):
        super().finalize_options()
        # Rebuild whenever asked: a library left in build/ by another Paddle
        # is newer than the sources and would otherwise be reused.
        self.force = True


def pybind_abi_defines():
    """The macros that give a pybind11 module libpaddle's internals id (read from the id the
    imported Paddle registered, e.g. ``__pybind11_internals_v4_gcc_libstdcpp_cxxabi1016__``):
    with the same id the two share one type registry.  The compiler here may have another
    ABI version number (the tag, not the layout of what crosses: ``std::string``,
    ``std::vector``, ``std::shared_ptr``), so the tag is taken from Paddle, not from it."""
    import builtins
    import re

    ids = [k for k in vars(builtins) if k.startswith("__pybind11_internals_v")]
    match = re.fullmatch(r"__pybind11_internals_v\d+(_[a-z]+)(_lib[a-z]+)(_cxxabi\d+)__", ids[0]) if ids else None
    if match is None:
        raise SystemExit(
            f"paddle_hybrid: cannot read the pybind11 internals id of this Paddle (found {ids}); "
            "the prefix store extension needs it. Report this with your Paddle version."
        )
    compiler, stdlib, abi = match.groups()
    return [f'-DPYBIND11_COMPILER_TYPE="{compiler}"', f'-DPYBIND11_STDLIB="{stdlib}"',
            f'-DPYBIND11_BUILD_ABI="{abi}"']


def prefix_store_extension():
    return CppExtension(
        name="paddle_hybrid._prefix_store",
        sources=[os.path.join(OPS_DIR, "prefix_store.cc")],
        extra_compile_args={"cxx": ["-O2", "-std=c++17"] + pybind_abi_defines()},
    )


def ops_extension():
    cflags = ["-O2", "-std=c++17"]
    if WITH_CUDA:
        return CUDAExtension(
            name="paddle_hybrid._custom_ops",
            sources=CPU_SOURCES + CUDA_SOURCES,
            include_dirs=[os.path.join(HERE, OPS_DIR)],
            extra_compile_args={
                "cxx": cflags + ["-DPADDLE_HYBRID_WITH_CUDA"],
                "nvcc": ["-O2", "-DPADDLE_HYBRID_WITH_CUDA"],
            },
        )
    return CppExtension(
        name="paddle_hybrid._custom_ops",
        sources=CPU_SOURCES,
        include_dirs=[os.path.join(HERE, OPS_DIR)],
        extra_compile_args={"cxx": cflags},
    )


setup(
    name="paddle_hybrid",
    version="0.1.0",
    description="Faster, easier hybrid-parallel (PP/VP/DP) training for PaddlePaddle fleet",
    packages=find_packages(include=["paddle_hybrid", "paddle_hybrid.*"]),
    python_requires=">=3.9",
    install_requires=["numpy"],
    # the step-time estimate's measured tables (python -m paddle_hybrid.plan)
    package_data={"paddle_hybrid.plan": ["tables/*.json", "tables/*.csv"]},
    ext_modules=[ops_extension(), prefix_store_extension()],
    cmdclass={"build_ext": BuildOps.with_options(no_python_abi_suffix=True)},
    zip_safe=False,
)
