"""Pointing entries of a loaded library's procedure linkage table at other functions, and back.

A call from ``libphi_core.so`` to a function it exports (``phi::ReduceScatterKernel<float,
phi::CPUContext>``, ``phi::distributed::GetDefaultPlace()``) goes through its own PLT: an indirect
jump through a slot of its global offset table that the dynamic linker fills with the function's
address.  Writing another address into that slot is what ``LD_PRELOAD`` would do for the whole
process, done for one library, after it was loaded, and undone by writing the saved value back.

This module reads the slots from the library's file (its ``.rela.plt`` relocations of type
``R_X86_64_JUMP_SLOT``, named through ``.dynsym``/``.dynstr``), finds where the library is mapped
(``/proc/self/maps``), and writes a slot (making its page writable for the write if the loader
made it read-only).  Linux x86-64 ELF only: :func:`available` says why not elsewhere.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import mmap
import os
import platform
import struct

__all__ = ["PltSlot", "available", "jump_slots", "demangle", "loaded_base", "write_slot", "read_slot"]

_R_X86_64_JUMP_SLOT = 7
_SHT_RELA, _SHT_DYNSYM = 4, 11


@dataclasses.dataclass(frozen=True)
class PltSlot:
    """One PLT slot of a library: the symbol it calls and where its pointer lives."""

    symbol: str
    """The mangled name (``_ZN3phi19ReduceScatterKernelIfNS_10CPUContextEEEv...``)."""
    offset: int
    """The slot's address relative to the library's load base."""


def available() -> tuple[bool, str]:
    """``(ok, why not)``: can slots be read and written in this process?"""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"PLT slots are handled on Linux x86-64 only, this is {platform.system()} {platform.machine()}"
    if not os.path.exists("/proc/self/maps"):
        return False, "/proc/self/maps is not readable"
    return True, ""


def _sections(data) -> list:
    """``[(name offset, type, file offset, size, link, entry size), ...]`` of an ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    out = []
    for i in range(shnum):
        name, kind, _flags, _addr, offset, size, link, _info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        out.append((name, kind, offset, size, link, entsize))
    return out


def _cstring(data, offset: int) -> str:
    end = data.find(b"\0", offset)
    return data[offset:end].decode("ascii", "replace")


_RELA = [("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")]
_SYM = [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]


def jump_slots(path: str, contains=()) -> list:
    """Every ``R_X86_64_JUMP_SLOT`` of the library at ``path`` whose mangled name contains one of
    ``contains`` (all of them when empty), as :class:`PltSlot`.

    ``libphi_core.so`` has about 87,000 relocations: read one by one in Python they cost about 0.3 s at every
    ``import paddle_hybrid`` of every rank.  The tables are read as arrays instead, and a name is
    decoded only where one of ``contains`` occurs in it (found by searching the string table)."""
    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        sections = _sections(data)
        slots = []
        for _name, kind, offset, size, link, entsize in sections:
            if kind != _SHT_RELA or link >= len(sections) or sections[link][1] != _SHT_DYNSYM:
                continue
            if (entsize or 24) != 24:
                raise ValueError(f"{path}: a RELA entry of {entsize} bytes, not 24")
            _, _, sym_offset, sym_size, str_index, sym_entsize = sections[link]
            if (sym_entsize or 24) != 24:
                raise ValueError(f"{path}: a symbol entry of {sym_entsize} bytes, not 24")
            str_offset, str_size = sections[str_index][2], sections[str_index][3]
            rela = np.frombuffer(data, dtype=_RELA, count=size // 24, offset=offset)
            symbols = np.frombuffer(data, dtype=_SYM, count=sym_size // 24, offset=sym_offset)
            rela = rela[(rela["info"] & 0xFFFFFFFF) == _R_X86_64_JUMP_SLOT]
            names = symbols["name"][(rela["info"] >> 32).astype(np.int64)].astype(np.int64)
            keep = _names_containing(data, str_offset, str_size, names, contains)
            for r_offset, name_offset in zip(rela["offset"][keep].tolist(), names[keep].tolist()):
                slots.append(PltSlot(_cstring(data, str_offset + name_offset), r_offset))
            del rela, symbols, names  # views of the mapping: it cannot close while they live
        return slots


def _names_containing(data, str_offset: int, str_size: int, names, contains):
    """A mask over ``names`` (offsets into the string table at ``str_offset``): which name holds
    one of ``contains``.  A name runs from its offset to the next NUL, and the linker may point
    several names into one string (a name may be another's tail), so a name holds an occurrence
    at ``p`` when it starts between that string's start and ``p``."""
    import numpy as np

    if not contains:
        return np.ones(len(names), dtype=bool)
    keep = np.zeros(len(names), dtype=bool)
    end = str_offset + str_size
    for needle in contains:
        needle = needle.encode()
        at = data.find(needle, str_offset, end)
        while at != -1:
            start = data.rfind(b"\0", str_offset, at) + 1 or str_offset
            keep |= (names >= start - str_offset) & (names <= at - str_offset)
            at = data.find(needle, at + 1, end)
    return keep


def demangle(symbol: str) -> str:
    """The C++ name of a mangled symbol (through the C++ runtime's ``__cxa_demangle``), or the
    symbol itself if it is not one."""
    runtime = _cxx_runtime()
    status = ctypes.c_int(0)
    raw = runtime.__cxa_demangle(symbol.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not raw:
        return symbol
    try:
        return ctypes.cast(raw, ctypes.c_char_p).value.decode()
    finally:
        _libc().free(ctypes.c_void_p(raw))


def loaded_base(path: str) -> int:
    """Where the library at ``path`` is mapped in this process (its first segment's address)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and os.path.realpath(parts[5]) == real and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise RuntimeError(f"paddle_hybrid: {path} is not loaded in this process.")


def read_slot(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def write_slot(address: int, value: int) -> None:
    """Write the pointer ``value`` at ``address``, making the page writable for the write if it is
    not (and read-only again after)."""
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    writable = _page_writable(address)
    libc = _libc()
    if not writable and libc.mprotect(ctypes.c_void_p(start), page, 3) != 0:  # PROT_READ | PROT_WRITE
        raise OSError(ctypes.get_errno(), f"paddle_hybrid: cannot make the page at {start:#x} writable")
    try:
        ctypes.c_void_p.from_address(address).value = value
    finally:
        if not writable:
            libc.mprotect(ctypes.c_void_p(start), page, 1)  # PROT_READ, as the loader left it


def _page_writable(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return "w" in perms
    raise RuntimeError(f"paddle_hybrid: address {address:#x} is not mapped.")


@functools.lru_cache(maxsize=None)
def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


@functools.lru_cache(maxsize=None)
def _cxx_runtime():
    runtime = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    runtime.__cxa_demangle.restype = ctypes.c_void_p
    runtime.__cxa_demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return runtime
