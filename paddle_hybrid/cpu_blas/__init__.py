"""Paddle's CPU BLAS at the machine's speed: ``MKL_DEBUG_CPU_TYPE=5`` on AMD CPUs where
Paddle's MKL honours it (plugin component ``cpu_blas``).

Paddle 3.3.1's and 3.2.2's CPU wheels bundle MKL 2019.0 Update 5.  On an AMD CPU it runs SGEMM
on a generic path (``paddle.matmul`` 1024x512 @ 512x2048 fp32 on one core of an EPYC: 28-35
GFLOP/s of CPU time); with the variable set before MKL's first CPU check, on its AVX2 path (66-79;
benchmarks/bench_cpu_blas.py).
:mod:`.decision` says when to set it, :mod:`.machine` reads the facts.

``import paddle_hybrid`` sets it in its own process (``apply``).  That works when no BLAS call
ran before the import: MKL reads the variable at its first call, not at load, and Paddle loads
MKL only then.  After setting it the component asks MKL which CPU type it dispatches on; if
that is not the type set, a BLAS call came first and the setting cannot help this process: the
variable is taken back and one warning names ``python -m paddle_hybrid.launch`` and the
variable.  For new processes :func:`worker_environment` gives the same decision
(``python -m paddle_hybrid.launch`` and ``scripts/env.sh`` export it;
``python -m paddle_hybrid.cpu_blas`` prints the shell line).

Uninstalling unsets the variable; MKL keeps the kernels it chose for the rest of the process.
"""
from __future__ import annotations

import os

from ..registry.component import Component, ComponentSkipped
from . import machine
from .decision import VALUE, VARIABLE, Decision, Facts, decide, format_version

__all__ = ["COMPONENT", "apply", "worker_environment", "shell_export",
           "CpuBlasWarning", "decide", "Facts", "Decision", "VARIABLE", "VALUE"]

class CpuBlasWarning(RuntimeWarning):
    """MKL already chose its kernels before the plugin could set ``MKL_DEBUG_CPU_TYPE``."""


class _TooLate(ComponentSkipped):
    category = CpuBlasWarning


_own_value: str | None = None  # the value this component set in this process
_too_late: str | None = None  # set once MKL was found to have chosen already: warned once
_pending: tuple[Facts, Decision] | None = None  # not_wanted's decision, for apply


def not_wanted(config) -> str | None:
    """Why this machine does not want the variable set (not an AMD CPU, an MKL that does not
    read it, the user's own value), or None."""
    global _pending
    if _too_late:
        return _too_late
    facts = machine.gather(os.environ, _own_value)
    decision = decide(facts)
    _pending = (facts, decision)
    return None if decision.set_value else decision.reason


def _restore(previous: str | None) -> None:
    global _own_value
    if os.environ.get(VARIABLE) == _own_value and _own_value is not None:
        if previous is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = previous
    _own_value = None


def _too_late_message(facts: Facts, cpu_type: int) -> str:
    return (f"Paddle's MKL {format_version(facts.mkl_version)} already chose its kernels (CPU type {cpu_type}) before "
            f"`import paddle_hybrid`: a matmul or other BLAS call ran first, so {VARIABLE}={VALUE} cannot take effect "
            f"in this process and SGEMM stays on MKL's generic path on this AMD CPU (about 3x slower than its AVX2 "
            f"path). Start with `python -m paddle_hybrid.launch ...` (it sets {VARIABLE} for every worker), or "
            f"`export {VARIABLE}={VALUE}` before Python starts, or import paddle_hybrid before the first matmul")


def apply(config, patcher) -> str:
    """Set the variable, then check with MKL that it took effect; returns the report's note."""
    global _own_value, _too_late
    facts, decision = _pending if _pending else (None, None)
    if decision is None or not decision.set_value:
        raise RuntimeError("paddle_hybrid.cpu_blas: apply() without a decision from not_wanted().")
    path, _ = machine.mkl_path(os.environ)
    mapped_before = machine.mapped_mkl() is not None
    previous = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = decision.set_value
    _own_value = decision.set_value
    patcher.on_revert(lambda: _restore(previous), f"environment variable {VARIABLE}")
    cpu_type = machine.mkl_cpu_type(path) if path else None
    if cpu_type is None:
        if mapped_before:
            return (f"{VARIABLE}={VALUE} set: {decision.reason}. MKL was loaded before the plugin and does not say "
                    "which kernels it chose, so whether this process gets them is unknown (new processes do)")
        return (f"{VARIABLE}={VALUE} set: {decision.reason}; set before MKL was loaded (Paddle loads it at its first "
                "BLAS call), so it applies")
    if cpu_type != int(decision.set_value):
        _restore(previous)
        _too_late = f"too late: {_too_late_message(facts, cpu_type)} (warned once)"
        raise _TooLate(_too_late_message(facts, cpu_type))
    return f"{VARIABLE}={VALUE} set: {decision.reason}; MKL now dispatches on CPU type {cpu_type}"


def _worker_decision(environ, config) -> Decision:
    """The component's decision, under ``config``, for a new process started with ``environ``; a
    value set by this plugin in this process does not count as the user's."""
    if not config.cpu_blas:
        return Decision(None, "off (PADDLE_HYBRID_CPU_BLAS=0)")
    return decide(machine.gather(os.environ if environ is None else environ, _own_value))


def worker_environment(environ=None, *, config) -> dict[str, str]:
    """What a new process (a launched worker) should get under ``config``: ``{VARIABLE: VALUE}``
    or ``{}``."""
    decision = _worker_decision(environ, config)
    return {VARIABLE: decision.set_value} if decision.set_value else {}


def shell_export(environ=None, *, config) -> tuple[str, str]:
    """``(shell line or "", reason)`` for ``scripts/env.sh``, under ``config``."""
    decision = _worker_decision(environ, config)
    return (f"export {VARIABLE}={decision.set_value}\n" if decision.set_value else ""), decision.reason


# Reads no Paddle API, only the MKL file of Paddle's wheel; both versions bundle MKL 2019.0.5.
COMPONENT = Component("cpu_blas", ("3.2.", "3.3."), "cpu_blas", apply, not_wanted=not_wanted)
