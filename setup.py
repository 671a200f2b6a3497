"""Build and install paddle_hybrid.

The custom ops in ``custom_ops/`` are compiled with Paddle's own custom-op
toolchain (``paddle.utils.cpp_extension``): CPU kernels always, CUDA kernels
when the installed Paddle is compiled with CUDA.  Paddle must therefore be
importable while building, so install with::

    pip install --no-build-isolation .        # or -e . for an editable install

The shared library lands at ``paddle_hybrid/_custom_ops.so`` and is loaded once
by ``paddle_hybrid.ops``.
"""
import os

from setuptools import find_packages, setup

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
CPU_SOURCES = [os.path.join(OPS_DIR, f) for f in ("nop.cc", "coalesce_tensor.cc", "uncoalesce_tensor.cc")]
CUDA_SOURCES = [os.path.join(OPS_DIR, "coalesce_tensor.cu")]
WITH_CUDA = paddle.is_compiled_with_cuda() and os.environ.get("PADDLE_HYBRID_NO_CUDA", "0") != "1"


class BuildOps(BuildExtension):
    """Paddle's BuildExtension (compiler flags, nvcc) without its egg-era
    extras: no generated Python stub and no ``*_pd_.so`` renaming, because
    ``paddle_hybrid.ops`` loads the library itself."""

    def run(self):
        from setuptools.command.build_ext import build_ext

        build_ext.run(self)


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
    ext_modules=[ops_extension()],
    cmdclass={"build_ext": BuildOps.with_options(no_python_abi_suffix=True)},
    zip_safe=False,
)
