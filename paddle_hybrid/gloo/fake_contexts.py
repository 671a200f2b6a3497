"""Comm contexts of the fake world in C++, and the log of every collective Paddle's C++ makes.

Why: the semi-auto API's reshards (``dist.reshard``, the Partial -> Replicate of a row-parallel
matmul, ``dist.parallelize``'s data-parallel gradients) and a static program's collectives run in
C++.  They find a comm context in ``phi::distributed::CommContextManager`` and call
``GlooCommContext::AllReduce``, ``AllGather``, ... on it; the context is made by
``CommContextManager::CreateGlooCommContext``, a gloo rendezvous with every peer of the group.  A
fake world (:mod:`.fake_world`) has no peer: the rendezvous would wait out the deadline, and no
Python patch reaches these calls.

What this does (``custom_ops/fake_comm.cc``): the PLT slots of ``libphi_core.so`` and
``libpaddle.so`` for ``CreateGlooCommContext`` and for every ``GlooCommContext`` method point at
the plugin's functions (:mod:`.plt`, undone at ``uninstall()``):

- ``CreateGlooCommContext`` makes, in a fake world, a context of the same rank, size and key that
  needs no peer; outside one, Paddle's (its key is remembered for the log);
- each method answers on a fake context as the Python fake world's process group does (the
  shapes are the real ones; the values: ``all_reduce``, ``reduce`` and ``broadcast`` give this
  rank's tensor, as if every rank held the same; ``all_gather`` and ``gather`` give it in every
  slot; ``scatter`` this rank's slot of what it holds; a receive gives ones for a floating tensor
  and zeros for another, a dynamic-shape receive is an error naming the peer), and calls Paddle's on
  a real one;
- the plugin's own C++ kernels (reduce_scatter, all_to_all, p_send, p_recv) answer the same way on
  a fake context (reduce_scatter: this rank's slot of its input; all_to_all: this rank's own part
  in every part).

Every one of these calls, fake or real, is logged while the log is on (the dry run, and the probe
of a real run it is compared with): op, the context's key, this rank's bytes (the input's; the
output's for reduce_scatter, scatter and a receive), the peer of a send or receive.  Python's
collectives take their sequence numbers from the same counter (:func:`next_seq`), so the two logs
merge in call order.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import warnings

from . import plt

__all__ = ["METHODS", "apply", "assumed", "count", "entries", "merged", "next_seq", "paused", "ranks_of_key",
           "replay", "sent", "slots", "unconfirmed"]

# The GlooCommContext methods replaced, with their parameters as the C++ runtime spells Paddle's
# (a slot whose function takes others is left alone).
METHODS = {
    "AllReduce": "(phi::DenseTensor*, phi::DenseTensor const&, int, unsigned int)",
    "Reduce": "(phi::DenseTensor*, phi::DenseTensor const&, int, int, unsigned int)",
    "Broadcast": "(phi::DenseTensor*, phi::DenseTensor const&, int, unsigned int)",
    "AllGather": "(phi::DenseTensor*, phi::DenseTensor const&, unsigned int)",
    "Gather": "(phi::DenseTensor*, phi::DenseTensor const&, int, unsigned int)",
    "Scatter": "(phi::DenseTensor*, phi::DenseTensor const&, int, int, unsigned int)",
    "Barrier": "()",
    "Send": "(phi::DenseTensor const&, int, unsigned int)",
    "Recv": "(phi::DenseTensor*, int, unsigned int)",
}
_CREATE = "CreateGlooCommContext"
_CREATE_PARAMETERS = re.compile(r"^\(std::shared_ptr<phi::distributed::Store> const&, std::__cxx11::basic_string<"
                                r"char, std::char_traits<char>, std::allocator<char> > const&, int, int\)$")
_STORE = "CreateOrGetGlobalTCPStore"  # replaced in a fake world only
_METHOD = re.compile(r"^phi::distributed::GlooCommContext::(\w+)(\(.*\))$")
_FACTORY = re.compile(r"^phi::distributed::CommContextManager::" + _CREATE + r"(\(.*\))$")

_STATE = {"applied": None}


@functools.lru_cache(maxsize=None)
def _library():
    from .. import ops

    library = ctypes.CDLL(ops.library_path())
    library.ph_fake_replacement.argtypes = [ctypes.c_char_p]
    library.ph_fake_replacement.restype = ctypes.c_void_p
    library.ph_comm_log_name.argtypes = [ctypes.c_char_p]
    library.ph_fake_comm_context.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    library.ph_fake_set_original.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    library.ph_comm_next_seq.restype = ctypes.c_longlong
    library.ph_comm_log_json.restype = ctypes.c_char_p
    library.ph_comm_log_count.restype = ctypes.c_longlong
    library.ph_fake_sent_json.restype = ctypes.c_char_p
    library.ph_fake_assumed_json.restype = ctypes.c_char_p
    library.ph_fake_replay_add.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_longlong), ctypes.c_int,
                                           ctypes.c_int]
    return library


def slots(path: str) -> list:
    """``[(slot, name), ...]``: the PLT slots of ``path`` for the functions replaced here (``name``:
    a key of :data:`METHODS`, ``"CreateGlooCommContext"`` or ``"CreateOrGetGlobalTCPStore"``), with
    Paddle 3.2-3.3's parameters."""
    found = []
    for slot in plt.jump_slots(path, contains=("GlooCommContext", _STORE)):
        name = plt.demangle(slot.symbol)
        method, factory = _METHOD.match(name), _FACTORY.match(name)
        if method and METHODS.get(method.group(1)) == method.group(2):
            found.append((slot, method.group(1)))
        elif factory and _CREATE_PARAMETERS.match(factory.group(1)):
            found.append((slot, _CREATE))
        elif name == f"phi::distributed::{_STORE}()":
            found.append((slot, _STORE))
    return found


def apply(patcher, fake: bool, store_port: int = 0, timeout: float = 900) -> str:
    """Phases: point the slots at the plugin's functions (recording Paddle's originals); turn the
    log on; with ``fake``, fake contexts on and the global store one of this process alone (on
    ``store_port``, waiting ``timeout`` s); undo all through ``patcher``.  Once a process."""
    if _STATE["applied"] is not None:
        raise RuntimeError("paddle_hybrid: the C++ comm contexts were replaced twice in one process")
    ok, why = plt.available()
    if not ok:
        if fake:  # a fake world without them would wait on its first C++ collective's peers
            raise RuntimeError(f"paddle_hybrid: the fake world needs the C++ comm contexts replaced: {why}")
        warnings.warn(f"paddle_hybrid: C++ collectives are not logged here ({why}): the probe's log holds the "
                      "Python ones only", RuntimeWarning, stacklevel=2)
        return f"C++ collectives not logged: {why}"
    library = _library()
    names = (*METHODS, _CREATE, _STORE) if fake else (*METHODS, _CREATE)
    _STATE["applied"] = _point_slots(patcher, library, names)
    patcher.on_revert(lambda: _STATE.update(applied=None), "the fake comm contexts' state")
    library.ph_comm_log_enable(1)
    patcher.on_revert(lambda: library.ph_comm_log_enable(0), "the C++ collectives' log")
    if fake:
        library.ph_fake_world(1, int(store_port), max(1, int(timeout)))
        patcher.on_revert(lambda: library.ph_fake_world(0, 0, 900), "fake C++ comm contexts")
    return f"{_STATE['applied']} PLT slots point at the plugin's comm-context functions" + (
        " (fake contexts)" if fake else " (logged)")


def _point_slots(patcher, library, names) -> int:
    from .kernels import _callers, _phi_core

    phi = ctypes.CDLL(_phi_core())  # the loaded library again: it defines them, for the originals
    count = 0
    for path in _callers():
        base, where = plt.loaded_base(path), os.path.basename(path)
        for slot, name in slots(path):
            if name not in names:
                continue
            new = library.ph_fake_replacement(name.encode())
            if not new:
                continue
            library.ph_fake_set_original(name.encode(), ctypes.cast(getattr(phi, slot.symbol), ctypes.c_void_p).value)
            address = base + slot.offset
            saved = plt.read_slot(address)
            plt.write_slot(address, new)
            patcher.on_revert(lambda a=address, v=saved: plt.write_slot(a, v), f"{where} PLT: GlooCommContext {name}")
            count += 1
    return count


def make_fake_context(key: str, rank: int, size: int) -> None:
    """A fake comm context under ``key`` in this fake world, as ``CreateGlooCommContext`` makes for the
    semi-auto API (Python's ``create_gloo_comm_context`` reaches Paddle's own through its address, not
    through the slot replaced here)."""
    if _library().ph_fake_comm_context(str(key).encode(), int(rank), int(size)) != 0:
        raise RuntimeError("paddle_hybrid: a fake comm context asked for outside the fake world")


def name_in_log(key: str) -> None:
    """The log names the real comm context under ``key`` (made by Python's ``create_gloo_comm_context``,
    which the replaced slot does not see) by its key, so its collectives' ranks are known."""
    if _STATE["applied"] is not None:
        _library().ph_comm_log_name(str(key).encode())


def next_seq() -> int:
    """The next number of the order C++ and Python collectives share."""
    return int(_library().ph_comm_next_seq())


@contextlib.contextmanager
def paused():
    """Nothing is logged in C++ meanwhile (a Python wrapper logs the one call it makes)."""
    library = _library()
    library.ph_comm_log_pause(1)
    try:
        yield
    finally:
        library.ph_comm_log_pause(-1)


def count() -> int:
    """How many collectives the C++ log holds."""
    return int(_library().ph_comm_log_count()) if _STATE["applied"] is not None else 0


def entries() -> list:
    """The C++ log so far: dicts of seq, op, key, rank, size, peer (-1: none), bytes."""
    if _STATE["applied"] is None:
        return []
    text = _library().ph_comm_log_json().decode()
    return [json.loads(line) for line in text.splitlines() if line]


def ranks_of_key(key: str, size: int) -> list | None:
    """The global ranks of a comm context's key, where Python knows them: a process group's id
    (fleet's and static programs' rings), or a reshard's key, which lists the ranks."""
    if key.isdigit():
        from paddle.distributed import collective

        group = collective._group_map.get(int(key))  # not _get_group_map(): it would add a world group
        if group is not None and group.nranks == size:
            return list(group.ranks)
        static = _static_program_group(int(key))
        if static is not None and len(static) == size:
            return static
        return list(range(size)) if key == "0" else None
    numbers = [int(n) for n in re.findall(r"\d+", key)]
    return numbers if len(numbers) == size else None


def _static_program_group(group_id: int) -> list | None:
    """The global ranks of an auto-parallel static program's process group ``group_id`` (its rings are
    numbered apart from ``paddle.distributed``'s groups), or None."""
    try:
        from paddle.distributed.auto_parallel.static import process_group
    except ImportError:
        return None
    group = process_group._g_process_group_map.get(group_id)
    return list(group.ranks) if group is not None else None


def merged(python_entries: list) -> list:
    """``python_entries`` (dicts with a ``seq`` from :func:`next_seq`) and the C++ log, in call order,
    as the fake world logs: op, group (global ranks, None where unknown), bytes, and the peer's
    global rank for a send or receive; without ``seq``."""
    cpp = []
    for e in entries():
        group = ranks_of_key(e["key"], e["size"])
        entry = {"op": e["op"], "group": group, "bytes": e["bytes"], "seq": e["seq"]}
        if e["peer"] >= 0:
            entry["peer"] = group[e["peer"]] if group is not None else e["peer"]
        cpp.append(entry)
    both = sorted(list(python_entries) + cpp, key=lambda entry: entry.get("seq", 0))
    return [{k: v for k, v in entry.items() if k != "seq"} for entry in both]


def sent() -> list:
    """What this process sent point to point on fake contexts, in order: dicts of pair (``"<context
    key>|<sender>-><receiver>"``, ranks within the context), dims, dtype (Paddle's enum value)."""
    text = _library().ph_fake_sent_json().decode()
    return [json.loads(line) for line in text.splitlines() if line]


def assumed() -> list:
    """The dynamic-shape receives of this process whose sender had not run: each took the shape of
    this rank's own message the other way at the same index (a pipeline's gradient is shaped as its
    activation).  Dicts of pair, index, dims, dtype; :func:`unconfirmed` checks them."""
    text = _library().ph_fake_assumed_json().decode()
    return [json.loads(line) for line in text.splitlines() if line]


def unconfirmed(assumed_records: list, sent_records: list) -> list:
    """Messages of ``assumed_records`` that the sender's own run (``sent_records``) sent with
    another shape or dtype: ``[(assumed, sent), ...]``.  One the sender never ran is not listed."""
    by_pair = {}
    for record in sent_records:
        by_pair.setdefault(record["pair"], []).append(record)
    wrong = []
    for record in assumed_records:
        sent = by_pair.get(record["pair"], [])
        if record["index"] < len(sent):
            actual = sent[record["index"]]
            if (actual["dims"], actual["dtype"]) != (record["dims"], record["dtype"]):
                wrong.append((record, actual))
    return wrong


def replay(records: list) -> None:
    """Give this process's fake contexts what earlier runs sent (:func:`sent`'s dicts, each pair in
    order): a dynamic-shape receive takes its shape from them."""
    library = _library()
    for record in records:
        dims = (ctypes.c_longlong * max(1, len(record["dims"])))(*record["dims"])
        library.ph_fake_replay_add(record["pair"].encode(), dims, len(record["dims"]), int(record["dtype"]))
