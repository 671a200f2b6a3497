"""The timeout of a gloo process group: what gloo waits for a peer before it raises ``TIMEOUT``.

Paddle creates every CPU process group with gloo's default of 30 s and offers no way to change
it: ``core.ProcessGroupGloo.create(store, rank, size, gid)`` takes none, and ``new_group(timeout=)``
does not reach gloo.  So a healthy pause of one rank (a checkpoint save, an evaluation, a loaded
machine) longer than 30 s kills the job.

Where the 30 s lives (Paddle 3.2 and 3.3): every operation of a ``ProcessGroupGloo`` (collectives,
send, recv, barrier) runs on the group's ``phi::distributed::GlooCommContext`` (the C++ method
``ProcessGroupGloo::GetCommContext()``), whose private ``gloo_context_`` (a ``gloo::Context``)
holds the timeout; each operation copies ``getTimeout()`` when it starts, so a new value applies
from the next operation on.  (``ProcessGroupGloo::get_context()`` returns another context that no
operation uses.)

How it is set, with nothing compiled: ``ctypes`` calls functions ``libpaddle``/``libphi_core``
export (``ProcessGroupGloo::GetCommContext``, ``gloo::Context::getTimeout`` / ``setTimeout``, whose
``std::chrono::milliseconds`` is one 64-bit integer in the x86-64 calling convention).  The C++
pointer of the Python group comes from pybind11's interop hook ``_pybind11_conduit_v1_`` (pybind11
>= 2.13), given Paddle's own ``type_info`` of ``ProcessGroupGloo``.  Before anything is written,
the layout is checked: the comm context's and the gloo context's virtual tables are the exported
ones, and the gloo context's rank and size equal the comm context's; memory is read with
``process_vm_readv``, so a wrong guess is an error, not a crash.  :func:`available` says whether
this Paddle has all of it (x86-64 Linux, the symbols); on anything else the plugin leaves gloo's
30 s and says so.
"""
from __future__ import annotations

import builtins
import ctypes
import os
import platform
import re

__all__ = ["GlooTimeoutUnavailable", "available", "comm_context", "get_comm_context_timeout_ms", "get_timeout_ms",
           "set_comm_context_timeout_ms", "set_timeout_ms"]

_GET_COMM_CONTEXT = "_ZN6paddle11distributed16ProcessGroupGloo14GetCommContextEv"
_SET_TIMEOUT = "_ZN4gloo7Context10setTimeoutENSt6chrono8durationIlSt5ratioILl1ELl1000EEEE"
_GET_TIMEOUT = "_ZNK4gloo7Context10getTimeoutEv"
_PG_TYPE_INFO = "_ZTIN6paddle11distributed16ProcessGroupGlooE"
_GLOO_COMM_CONTEXT_VTABLE = "_ZTVN3phi11distributed15GlooCommContextE"
_RENDEZVOUS_CONTEXT_VTABLE = "_ZTVN4gloo10rendezvous7ContextE"
_PG_CAPSULE = b"N6paddle11distributed16ProcessGroupGlooE"  # what the conduit names its capsule
_TYPE_INFO_CAPSULE = b"St9type_info"

_cache: dict = {}


class GlooTimeoutUnavailable(RuntimeError):
    """This Paddle (or machine) does not let the plugin set a gloo group's timeout."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load() -> dict:
    """The functions and addresses used, found once; raises :class:`GlooTimeoutUnavailable`."""
    if "error" in _cache:
        raise GlooTimeoutUnavailable(_cache["error"])
    if "set" in _cache:
        return _cache
    try:
        _cache.update(_find())
    except (OSError, AttributeError, ValueError, GlooTimeoutUnavailable) as exc:
        _cache["error"] = str(exc)
        raise GlooTimeoutUnavailable(str(exc)) from None
    return _cache


def _find() -> dict:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise GlooTimeoutUnavailable(f"written for x86-64 Linux, this is {platform.system()} {platform.machine()}")
    import paddle

    root = os.path.dirname(paddle.__file__)
    libpaddle = ctypes.CDLL(os.path.join(root, "base", "libpaddle.so"))
    phi_core = ctypes.CDLL(os.path.join(root, "libs", "libphi_core.so"))
    get_comm = getattr(libpaddle, _GET_COMM_CONTEXT)
    get_comm.restype, get_comm.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    set_timeout = getattr(phi_core, _SET_TIMEOUT)
    set_timeout.restype, set_timeout.argtypes = None, [ctypes.c_void_p, ctypes.c_int64]
    get_timeout = getattr(phi_core, _GET_TIMEOUT)
    get_timeout.restype, get_timeout.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    abi = [k for k in vars(builtins) if k.startswith("__pybind11_internals_v")]
    match = re.fullmatch(r"__pybind11_internals_v\d+(_\w+?)__", abi[0]) if abi else None
    if match is None:
        raise GlooTimeoutUnavailable(f"cannot tell pybind11's platform ABI from {abi}")

    def address(lib, name):
        return ctypes.addressof(ctypes.c_char.in_dll(lib, name))

    word = ctypes.sizeof(ctypes.c_void_p)
    libc = ctypes.CDLL(None)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    return {"get_comm": get_comm, "set": set_timeout, "get": get_timeout, "abi": match.group(1).encode(),
            "pg_type_info": address(libpaddle, _PG_TYPE_INFO), "libc": libc,
            # a virtual table pointer points two words into the exported table (offset, type info)
            "comm_vptr": address(phi_core, _GLOO_COMM_CONTEXT_VTABLE) + 2 * word,
            "gloo_vptr": address(phi_core, _RENDEZVOUS_CONTEXT_VTABLE) + 2 * word}


def available() -> tuple[bool, str]:
    """``(True, "")``, or ``(False, why not)``."""
    try:
        _load()
        return True, ""
    except GlooTimeoutUnavailable as exc:
        return False, str(exc)


def _read(address: int, size: int) -> bytes:
    """``size`` bytes of this process at ``address``; an unmapped address is an error."""
    buffer = ctypes.create_string_buffer(size)
    local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), size)
    remote = _IoVec(address, size)
    if _load()["libc"].process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != size:
        raise GlooTimeoutUnavailable(f"cannot read {size} bytes at {address:#x}")
    return buffer.raw


def _word(raw: bytes, offset: int) -> int:
    return int.from_bytes(raw[offset:offset + 8], "little")


def _int(raw: bytes, offset: int) -> int:
    return int.from_bytes(raw[offset:offset + 4], "little", signed=True)


def comm_context(process_group) -> int:
    """Address of the ``phi::distributed::GlooCommContext`` every operation of ``process_group`` (a
    ``ProcessGroupGloo``) runs on, its virtual table checked (:mod:`.all_to_all` hands it to C++)."""
    lib = _load()
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype, capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    conduit = getattr(process_group, "_pybind11_conduit_v1_", None)
    if conduit is None:
        raise GlooTimeoutUnavailable(f"{type(process_group).__name__} has no pybind11 conduit (pybind11 < 2.13)")
    out = conduit(lib["abi"], capsule_new(lib["pg_type_info"], _TYPE_INFO_CAPSULE, None), b"raw_pointer_ephemeral")
    if out is None:
        raise GlooTimeoutUnavailable(f"{type(process_group).__name__} is not a ProcessGroupGloo")
    comm = lib["get_comm"](get_pointer(out, _PG_CAPSULE))
    if not comm:
        raise GlooTimeoutUnavailable("the group has no gloo comm context")
    if _word(_read(comm, 8), 0) != lib["comm_vptr"]:
        raise GlooTimeoutUnavailable("the group's comm context is not the GlooCommContext this was written for")
    return comm


def _gloo_context(process_group) -> int:
    """Address of the ``gloo::Context`` the group's operations use, its layout checked."""
    return _gloo_context_of(comm_context(process_group))


def _gloo_context_of(comm: int) -> int:
    """Address of the ``gloo::Context`` of the ``GlooCommContext`` at ``comm``, its layout checked."""
    lib = _load()
    if _word(_read(comm, 8), 0) != lib["comm_vptr"]:
        raise GlooTimeoutUnavailable("the comm context is not the GlooCommContext this was written for")
    head = _read(comm, 24)  # vptr, int rank, int size, shared_ptr<gloo::rendezvous::Context> (pointer first)
    context = _word(head, 16)
    gloo = _read(context, 16)  # vptr, int rank, int size
    if _word(gloo, 0) != lib["gloo_vptr"] or (_int(gloo, 8), _int(gloo, 12)) != (_int(head, 8), _int(head, 12)):
        raise GlooTimeoutUnavailable("the GlooCommContext's gloo context is not laid out as this was written for")
    return context


def get_timeout_ms(process_group) -> int:
    """The timeout of ``process_group``'s operations, in milliseconds."""
    return _load()["get"](_gloo_context(process_group))


def set_timeout_ms(process_group, milliseconds: int) -> None:
    """From ``process_group``'s next operation on, gloo waits ``milliseconds`` for a peer."""
    _check_ms(milliseconds)
    _load()["set"](_gloo_context(process_group), milliseconds)


def get_comm_context_timeout_ms(comm: int) -> int:
    """The timeout of the ``GlooCommContext`` at address ``comm`` (one the comm-context manager
    holds, not a process group's), in milliseconds."""
    return _load()["get"](_gloo_context_of(comm))


def set_comm_context_timeout_ms(comm: int, milliseconds: int) -> None:
    """From the next operation on the ``GlooCommContext`` at address ``comm``, gloo waits
    ``milliseconds`` for a peer."""
    _check_ms(milliseconds)
    _load()["set"](_gloo_context_of(comm), milliseconds)


def _check_ms(milliseconds) -> None:
    if isinstance(milliseconds, bool) or not isinstance(milliseconds, int) or milliseconds < 1:
        raise ValueError(f"paddle_hybrid: a gloo timeout must be a positive number of milliseconds, got {milliseconds!r}.")
