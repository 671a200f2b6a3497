"""Real CPU kernels over gloo where Paddle's CPU build has only ones that throw, reached by
Paddle's own C++.

Paddle 3.3's CPU kernels ``ReduceScatterKernel``, ``AllToAllKernel``, ``PSendKernel`` and
``PRecvKernel`` throw ("Unimplemented cpu kernel"), so the semi-auto reshards that need them
(Partial -> Shard, Shard(i) -> Shard(j), a pipeline across meshes) stop on CPU; and
``phi::distributed::GetDefaultPlace()`` of the CPU wheel (built with custom-device support) reads
the first custom device type of an empty list: a segfault for a rank outside a mesh.  The reshard
functions are C++ and call these functions directly, so no Python patch reaches them.

What this does: ``custom_ops/gloo_kernels.cc`` (in the plugin's op library) holds a gloo
implementation of each kernel for every type Paddle instantiates, and a ``GetDefaultPlace`` that
answers the CPU place.  ``libphi_core.so`` calls all of these through its own procedure linkage
table (:mod:`.plt`), ``libpaddle.so`` calls ``GetDefaultPlace`` through its own (eager autograd
filling an empty gradient); :func:`apply` points those slots at the plugin's functions, and the patcher
writes the saved values back at ``paddle_hybrid.uninstall()``.  The kernel factory's wrappers of
these kernels call through the same slots, so an op (``_C_ops.reduce_scatter``, a static program's
``pd_op.reduce_scatter``) reaches them as well.

Per call, the plugin's kernel does gloo work only when the device context carries a gloo comm
context; with any other it calls Paddle's original (the device rule).  ``GetDefaultPlace`` is
replaced only in a process with no custom device registered, where the CPU place is the answer a
build without custom-device support gives.
"""
from __future__ import annotations

import ctypes
import os
import re

from . import collectives, plt

__all__ = ["apply", "KERNELS", "calls", "slots"]

# The parameters each of the plugin's functions takes (custom_ops/gloo_kernels.cc), as the C++
# runtime spells Paddle's: a slot whose function takes others (another Paddle) is left alone.
SIGNATURES = {
    "ReduceScatterKernel": "(phi::CPUContext const&, phi::DenseTensor const&, int, phi::DenseTensor*)",
    "AllToAllKernel": "(phi::CPUContext const&, phi::DenseTensor const&, phi::DenseTensor*)",
    "PSendKernel": "(phi::CPUContext const&, phi::DenseTensor const&, int, bool)",
    "PRecvKernel": "(phi::CPUContext const&, int, phi::DataType, std::vector<int, std::allocator<int> > const&, bool, "
                   "phi::DenseTensor*)",
}
KERNELS = tuple(SIGNATURES)
_KERNEL_NAME = re.compile(r"^void phi::(" + "|".join(KERNELS) + r")<(.+), phi::CPUContext>(\(.*\))$")
_DEFAULT_PLACE = "phi::distributed::GetDefaultPlace()"
_GLOO_VTABLE = "_ZTVN3phi11distributed15GlooCommContextE"


def _phi_core() -> str:
    import paddle

    return os.path.join(os.path.dirname(paddle.__file__), "libs", "libphi_core.so")


def _callers() -> list:
    """The Paddle libraries whose PLT calls these functions: libphi_core.so (the kernels, the
    reshard functions) and libpaddle.so (eager autograd asks GetDefaultPlace() too)."""
    import paddle

    root = os.path.dirname(paddle.__file__)
    return [_phi_core(), os.path.join(root, "base", "libpaddle.so")]


def _ops_library():
    from .. import ops

    return ctypes.CDLL(ops.library_path())


def slots(path: str | None = None) -> list:
    """``[(slot, kernel, type), ...]``: every PLT slot of ``path`` (``libphi_core.so`` by default) for a CPU kernel of
    :data:`KERNELS` with the parameters of :data:`SIGNATURES` (``kernel`` and ``type`` as C++ names
    them: ``"ReduceScatterKernel"``, ``"float"``), and the one of ``GetDefaultPlace`` (kernel
    ``"GetDefaultPlace"``, type "")."""
    found = []
    for slot in plt.jump_slots(path or _phi_core(), contains=(*KERNELS, "GetDefaultPlace")):
        name = plt.demangle(slot.symbol)
        match = _KERNEL_NAME.match(name)
        if match and match.group(3) == SIGNATURES[match.group(1)]:
            found.append((slot, match.group(1), match.group(2)))
        elif name == _DEFAULT_PLACE:
            found.append((slot, "GetDefaultPlace", ""))
    return found


def set_gloo_vtable(library) -> None:
    """Tell the op library where a ``GlooCommContext``'s vtable pointer points: how its functions
    tell a gloo comm context from any other."""
    phi = ctypes.CDLL(_phi_core())
    library.ph_gloo_set_vtable.argtypes = [ctypes.c_void_p]
    # An object's vtable pointer points two words into its class's vtable symbol (offset, typeinfo).
    library.ph_gloo_set_vtable(ctypes.cast(getattr(phi, _GLOO_VTABLE), ctypes.c_void_p).value + 16)


def calls(kernel: str) -> int:
    """How many calls of ``kernel`` did gloo work in this process."""
    library = _ops_library()
    library.ph_gloo_calls.restype = ctypes.c_longlong
    return int(library.ph_gloo_calls(kernel.encode()))


def _replacement(library, kernel: str, type_name: str) -> int:
    library.ph_gloo_kernel.restype = ctypes.c_void_p
    library.ph_cpu_default_place.restype = ctypes.c_void_p
    if kernel == "GetDefaultPlace":
        return library.ph_cpu_default_place() or 0
    return library.ph_gloo_kernel(kernel.encode(), type_name.encode()) or 0


def _custom_devices() -> list:
    import paddle

    return list(paddle.device.get_all_custom_device_type() or [])


def apply(config, patcher) -> str:
    """Phases: point the slots at the plugin's kernels (:func:`_point_slots`); then Paddle's Python
    ``reduce_scatter`` on gloo groups, through the kernel where it is in place
    (:func:`.collectives.apply_reduce_scatter`)."""
    replaced = _point_slots(patcher)
    collectives.apply_reduce_scatter(patcher, use_kernel="ReduceScatterKernel<float>" in replaced)
    return f"{len(replaced)} PLT slots of libphi_core.so and libpaddle.so point at the plugin's gloo kernels"


def _point_slots(patcher) -> list:
    """Phases: can slots be written here? find them; record Paddle's originals with the plugin's
    library; point each slot at the plugin's function (undone newest first through ``patcher``).
    Returns what was replaced (``"ReduceScatterKernel<float>"``, ...)."""
    ok, _why = plt.available()
    if not ok:
        return []
    library = _ops_library()
    phi = ctypes.CDLL(_phi_core())  # the loaded library again: it defines them, for the originals
    library.ph_gloo_set_original.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
    set_gloo_vtable(library)
    custom = _custom_devices()
    replaced = []
    for path in _callers():
        base, where = plt.loaded_base(path), os.path.basename(path)
        for slot, kernel, type_name in slots(path):
            if kernel == "GetDefaultPlace" and custom:
                continue  # Paddle's answer is right where a custom device exists
            new = _replacement(library, kernel, type_name)
            if not new:
                continue  # a type the plugin has no kernel for keeps Paddle's
            original = ctypes.cast(getattr(phi, slot.symbol), ctypes.c_void_p).value
            library.ph_gloo_set_original(kernel.encode(), type_name.encode(), original)
            address = base + slot.offset
            saved = plt.read_slot(address)
            plt.write_slot(address, new)
            patcher.on_revert(lambda a=address, v=saved: plt.write_slot(a, v), f"{where} PLT: {kernel}<{type_name}>")
            replaced.append(f"{kernel}<{type_name}>" if type_name else kernel)
    return replaced
