"""MKL's code paths on this machine: the one the plugin's processes take, and a second one to run
the same numbers on, so a tolerance that holds on one CPU only is seen before a user's machine
shows it.

Why: MKL picks its kernels by the CPU (AVX-512 on a recent Intel, AVX2 or AVX on older ones, a
generic path or, with ``MKL_DEBUG_CPU_TYPE=5``, AVX2 on AMD).  Different kernels round a matmul
differently, so a comparison between two runs that do not do the same arithmetic (a sum in
another order) can pass on one CPU and fail on another.  Running the suite once more on the
second path finds such a comparison on whatever machine runs it.

A pure function of the machine's facts (:func:`alternate_path`), like :mod:`.decision`;
:func:`current_path` asks MKL which kernels it took.
"""
from __future__ import annotations

import dataclasses

from .decision import AMD, INTEL, VALUE, VARIABLE, Decision

__all__ = ["CodePath", "ENABLE_INSTRUCTIONS", "OFF_SWITCH", "CPU_TYPES", "alternate_path", "describe_cpu_type",
           "shell_lines"]

ENABLE_INSTRUCTIONS = "MKL_ENABLE_INSTRUCTIONS"  # caps the instruction set MKL dispatches to (Intel CPUs)
OFF_SWITCH = "PADDLE_HYBRID_CPU_BLAS"  # the plugin's own switch of MKL_DEBUG_CPU_TYPE=5

# What MKL 2019's mkl_serv_cpu_detect returns (read on an Intel Xeon with AVX-512: 7 by default,
# 5 with MKL_ENABLE_INSTRUCTIONS=AVX2, 4 with =AVX).
CPU_TYPES = {4: "AVX", 5: "AVX2", 6: "AVX-512 (Xeon Phi)", 7: "AVX-512"}


@dataclasses.dataclass(frozen=True)
class CodePath:
    """A second way MKL runs on this machine and the environment that selects it."""

    label: str
    """What it is, for a log line: "MKL's AVX2 kernels (MKL_ENABLE_INSTRUCTIONS=AVX2)"."""
    environment: dict
    """Variable -> value to export, or None to unset it."""


def alternate_path(vendor: str | None, flags: frozenset, decision: Decision) -> CodePath | None:
    """The second code path for a CPU with ``vendor`` and ``flags`` (``/proc/cpuinfo``), given the
    plugin's own ``decision`` for ``MKL_DEBUG_CPU_TYPE``; None where none is known."""
    if vendor == INTEL and "avx512f" in flags:
        return CodePath(f"MKL's AVX2 kernels ({ENABLE_INSTRUCTIONS}=AVX2), not its AVX-512 ones",
                        {ENABLE_INSTRUCTIONS: "AVX2"})
    if vendor == INTEL and "avx2" in flags:
        return CodePath(f"MKL's AVX kernels ({ENABLE_INSTRUCTIONS}=AVX), not its AVX2 ones",
                        {ENABLE_INSTRUCTIONS: "AVX"})
    if vendor == AMD and decision.set_value == VALUE:
        # The plugin's default here is the AVX2 path; the other one is MKL's generic path, which
        # stock Paddle takes on this CPU.  The plugin must not set the variable again in each worker.
        return CodePath(f"MKL's generic kernels (stock Paddle on this AMD CPU; {OFF_SWITCH}=0), not its AVX2 ones",
                        {OFF_SWITCH: "0", VARIABLE: None})
    return None


def describe_cpu_type(cpu_type: int | None) -> str:
    if cpu_type is None:
        return "unknown (this MKL does not say)"
    return f"CPU type {cpu_type} ({CPU_TYPES.get(cpu_type, 'generic or other')})"


def shell_lines(path: CodePath) -> str:
    """``export``/``unset`` lines selecting ``path`` in a shell."""
    return "".join(f"unset {k}\n" if v is None else f"export {k}={v}\n" for k, v in sorted(path.environment.items()))
