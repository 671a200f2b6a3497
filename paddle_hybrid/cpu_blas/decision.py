"""Should ``MKL_DEBUG_CPU_TYPE=5`` be set?  A pure function of the machine's facts, so every
case is testable with the facts faked (:mod:`.machine` reads the real ones).

Why: MKL up to 2020.0 dispatches by CPU vendor; on an AMD CPU it runs SGEMM on its generic
path, about 3x slower than its AVX2 path on the same core.  Those versions honour
``MKL_DEBUG_CPU_TYPE=5``, which makes them take the AVX2 path; MKL 2020 Update 1 and later
ignore it (and dispatch AMD better themselves in newer releases).  MKL reads the variable once,
at its first CPU check (the first BLAS call), not when it is loaded.
"""
from __future__ import annotations

import dataclasses

__all__ = ["VARIABLE", "VALUE", "LAST_HONOURING", "Facts", "Decision", "decide", "format_version"]

VARIABLE = "MKL_DEBUG_CPU_TYPE"
VALUE = "5"  # MKL's code for its AVX2 kernels
LAST_HONOURING = (2020, 0, 0)  # (major, minor, update): 2020.0 honours it, 2020.0 Update 1 does not
AMD = "AuthenticAMD"
INTEL = "GenuineIntel"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the decision needs to know about this machine and this Paddle."""

    vendor: str | None
    """``vendor_id`` of the CPU (``"AuthenticAMD"``, ``"GenuineIntel"``, ...), None if unknown."""
    vendor_note: str = ""
    """Where the vendor came from, or why it is unknown."""
    avx2_fma: bool = False
    """The CPU has AVX2 and FMA (MKL's AVX2 kernels need both)."""
    mkl_version: tuple | None = None
    """``(major, minor, update)`` of the MKL Paddle loads, None if not read or unreadable."""
    mkl_note: str = ""
    """The MKL library's path, or why its version is unknown."""
    preset: str | None = None
    """``MKL_DEBUG_CPU_TYPE`` as set before the plugin looked (by the user, scripts/env.sh or
    ``python -m paddle_hybrid.launch``), None if unset."""


@dataclasses.dataclass(frozen=True)
class Decision:
    set_value: str | None
    """The value to set, or None: leave the environment alone."""
    reason: str


def format_version(version) -> str:
    major, minor, update = version
    return f"{major}.{minor}" + (f" Update {update}" if update else "")


def decide(facts: Facts) -> Decision:
    """Set the variable only where it is known to help: an AMD CPU with AVX2 and FMA, an MKL
    that honours it, and no value chosen by anyone before."""
    if facts.preset is not None:
        return Decision(None, f"{VARIABLE}={facts.preset} was set before the plugin (by you, scripts/env.sh or "
                              "python -m paddle_hybrid.launch); left as it is")
    if facts.vendor is None:
        return Decision(None, f"CPU vendor unknown ({facts.vendor_note or 'not read'}); {VARIABLE} not set")
    if facts.vendor == INTEL:
        return Decision(None, "Intel CPU: MKL picks its fast kernels by itself; nothing to do")
    if facts.vendor != AMD:
        return Decision(None, f"CPU vendor {facts.vendor}, not AMD: nothing to do")
    if not facts.avx2_fma:
        return Decision(None, f"AMD CPU without AVX2/FMA: MKL's AVX2 kernels cannot run on it; {VARIABLE} not set")
    if facts.mkl_version is None:
        return Decision(None, f"AMD CPU, but the version of Paddle's MKL is unknown ({facts.mkl_note}); only MKL up "
                              f"to {format_version(LAST_HONOURING)} honours {VARIABLE}, so it is not set")
    if tuple(facts.mkl_version) > LAST_HONOURING:
        return Decision(None, f"AMD CPU, MKL {format_version(facts.mkl_version)}: MKL after "
                              f"{format_version(LAST_HONOURING)} ignores {VARIABLE}; nothing to do")
    return Decision(VALUE, f"AMD CPU with AVX2/FMA and MKL {format_version(facts.mkl_version)} (honours {VARIABLE}): "
                           f"{VARIABLE}={VALUE} selects MKL's AVX2 kernels instead of its generic ones")
