"""The real facts behind :func:`.decision.decide`: the CPU (``/proc/cpuinfo``) and the MKL
library Paddle uses, read through ``ctypes`` from the library file itself (its version is not
inferred from Paddle's).

Paddle's CPU wheels bundle ``libs/libmklml_intel.so`` and ``dlopen`` it at their first BLAS
call (``phi::dynload``), not at ``import paddle``; a library already mapped into this process
therefore means a BLAS call may have happened.  Loading it here to read its version does not
make MKL check the CPU (seen on MKL 2019.0.5: the variable set after the version query still
took effect), and when Paddle loads it later it gets this same copy (same soname).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os

from .decision import VARIABLE, Facts

__all__ = ["CPUINFO", "MKL_FILE", "read_cpu", "read_flags", "mapped_mkl", "mkl_path", "mkl_version", "mkl_cpu_type", "gather"]

CPUINFO = "/proc/cpuinfo"
MKL_FILE = "libmklml_intel.so"  # the MKL Paddle's CPU wheels bundle (libs/) and dlopen


def read_cpu(path: str = CPUINFO) -> tuple[str | None, str, bool]:
    """``(vendor_id or None, where from / why unknown, has AVX2 and FMA)`` of the first CPU."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError as exc:
        return None, f"no {path} on this OS ({exc.strerror})", False
    vendor, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and vendor is None:
            vendor = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        if vendor and flags:
            break
    return vendor, (path if vendor else f"no vendor_id in {path}"), {"avx2", "fma"} <= flags


def read_flags(path: str = CPUINFO) -> frozenset:
    """The instruction-set flags of the first CPU (``avx2``, ``avx512f``, ...); empty if unreadable."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def mapped_mkl() -> str | None:
    """Path of an MKL library already mapped into this process (Linux), else None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("/" + MKL_FILE):
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def mkl_path(environ) -> tuple[str | None, str]:
    """``(path, note)``: the MKL Paddle uses here: the one it already loaded, else the one it
    will load (``FLAGS_mklml_dir`` or Paddle's ``libs/``), found without importing Paddle."""
    loaded = mapped_mkl()
    if loaded:
        return loaded, loaded
    if environ.get("FLAGS_mklml_dir"):
        candidates = [os.path.join(environ["FLAGS_mklml_dir"], MKL_FILE)]
    else:
        spec = importlib.util.find_spec("paddle")
        if spec is None or not spec.submodule_search_locations:
            return None, "Paddle not found"
        candidates = [os.path.join(d, "libs", MKL_FILE) for d in spec.submodule_search_locations]
    for path in candidates:
        if os.path.exists(path):
            return path, path
    return None, f"this Paddle has no {MKL_FILE} (looked at {', '.join(candidates)})"


class _MKLVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("update", ctypes.c_int),
                ("product_status", ctypes.c_char_p), ("build", ctypes.c_char_p),
                ("processor", ctypes.c_char_p), ("platform", ctypes.c_char_p)]


def _load(path: str) -> ctypes.CDLL:
    """The library, as Paddle would get it.  It needs ``libiomp5.so``, which ``import paddle``
    has loaded (libpaddle links it); without Paddle imported, load the copy beside it first."""
    try:
        return ctypes.CDLL(path)
    except OSError:
        iomp = os.path.join(os.path.dirname(path), "libiomp5.so")
        if not os.path.exists(iomp):
            raise
        ctypes.CDLL(iomp, mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(path)


def mkl_version(path: str) -> tuple[tuple | None, str]:
    """``((major, minor, update) or None, note)`` from ``MKL_Get_Version`` of the library."""
    try:
        lib = _load(path)
        get = lib.MKL_Get_Version
    except (OSError, AttributeError) as exc:
        return None, f"{path}: {exc}"
    version = _MKLVersion()
    get.restype = None
    get(ctypes.byref(version))
    return (version.major, version.minor, version.update), path


def mkl_cpu_type(path: str) -> int | None:
    """The CPU type MKL dispatches on (``mkl_serv_cpu_detect``, an internal but exported
    function of MKL 2019/2020), None if this MKL lacks it.  The first call makes MKL check the
    CPU and read ``MKL_DEBUG_CPU_TYPE``; later calls return that first answer, also after the
    variable changed.  So after setting the variable, a type other than the one set means MKL
    had already chosen: a BLAS call ran first."""
    try:
        detect = _load(path).mkl_serv_cpu_detect
    except (OSError, AttributeError):
        return None
    detect.restype = ctypes.c_int
    return int(detect())


def gather(environ, own_value: str | None = None) -> Facts:
    """The facts for :func:`.decision.decide`.  ``own_value``: the value this plugin set in this
    process, which is not a preset.  MKL is only read on an AMD CPU (where it matters)."""
    vendor, vendor_note, avx2_fma = read_cpu()
    preset = environ.get(VARIABLE)
    if preset is not None and preset == own_value:
        preset = None
    version, mkl_note = None, "not read (not an AMD CPU)"
    if vendor == "AuthenticAMD":
        path, mkl_note = mkl_path(environ)
        if path is not None:
            version, mkl_note = mkl_version(path)
    return Facts(vendor=vendor, vendor_note=vendor_note, avx2_fma=avx2_fma, mkl_version=version,
                 mkl_note=mkl_note, preset=preset)
