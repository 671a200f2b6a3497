"""All-to-all on gloo: the whole family of ``ProcessGroupGloo`` all-to-all methods.

Paddle's gloo process group refuses every all-to-all ("ProcessGroupGLOO does not support
all_to_all with sync_op flag"), and expert parallelism is built on it: ``dist.alltoall``,
``dist.alltoall_single`` (the token dispatchers), ``dist.stream.alltoall_single`` and, in
``MoELayer.count_by_gate``, ``group.process_group.alltoall`` called directly.  So the methods
are replaced on the ``ProcessGroupGloo`` class itself, which every one of those paths reaches:

=====================================  ==============================================
method (what calls it)                 what it moves
=====================================  ==============================================
``all_to_all(out_list, in_list, s)``   ``in_list[p]`` to rank ``p``, into ``out_list``
``all_to_all_on_calc_stream``          the same, synchronous
``all_to_all_tensor(out, in, s)``      equal dim-0 parts of ``in``
``all_to_all_single(out, in, o, i, s)``dim-0 parts of sizes ``i`` (sent) / ``o`` (received)
``..._on_calc_stream`` of both         the same, synchronous
legacy ``alltoall(in, out)``           equal dim-0 parts (input first, as Paddle's)
legacy ``alltoall_single(in, out, i, o)`` as ``all_to_all_single``
=====================================  ==============================================

**How the bytes move: in C++, pairwise.**  ``ph_gloo_all_to_all_v`` of the plugin's op library
(``custom_ops/gloo_kernels.cc``) runs on the group's own ``GlooCommContext`` (its address from
:func:`.context_timeout.comm_context`): rounds of the circle method in which every rank exchanges
with exactly one partner (``n - 1`` rounds for an even group, ``n`` with one rank idle a round
for an odd one), the lower rank sending first.  Each byte crosses the wire once, from its sender
straight out of the input tensor into the receiver's output tensor; a part of no rows is not
sent.  (Before: the same schedule driven from Python, a ``send``/``recv`` call and a copy a part,
and for an odd group a padded scatter per rank.)

Per call, the device rule: a tensor that is not in host memory goes to Paddle's original
method unchanged (which refuses it, as before); groups of another backend never reach this
module, since only ``ProcessGroupGloo`` is patched.  Gloo's operations complete inside the
call, so ``sync_op=False`` returns a task that is already complete; ``wait()`` returns at once.
"""
from __future__ import annotations

import functools

from ..registry.device import on_cpu
from .collectives import DoneTask

__all__ = ["apply", "PATCHED_METHODS", "exchange", "exchange_single", "split_sizes"]


# ---------------------------------------------------------------------------
# the exchange
# ---------------------------------------------------------------------------

_native: dict = {}


def _all_to_all_v():
    """``ph_gloo_all_to_all_v`` of the op library, its argument types set, once; the library is
    told ``GlooCommContext``'s vtable so it can check what it is given."""
    if "fn" not in _native:
        import ctypes

        from .. import ops
        from .kernels import set_gloo_vtable

        library = ctypes.CDLL(ops.library_path())
        set_gloo_vtable(library)
        fn = library.ph_gloo_all_to_all_v
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int]
        _native["fn"] = fn
    return _native["fn"]


def _exchange_rows(pg, send, send_rows, recv, recv_rows) -> None:
    """Dim-0 parts of contiguous CPU tensor ``send`` (``send_rows[p]`` rows to rank ``p``) into
    contiguous ``recv`` (``recv_rows[p]`` rows from rank ``p``), in place."""
    import ctypes

    from .context_timeout import comm_context

    nranks = pg.size()
    row_bytes = _row_elements(send) * send.element_size()
    send_bytes = (ctypes.c_int64 * nranks)(*[int(r) * row_bytes for r in send_rows])
    recv_bytes = (ctypes.c_int64 * nranks)(*[int(r) * row_bytes for r in recv_rows])
    error = ctypes.create_string_buffer(2048)
    status = _all_to_all_v()(comm_context(pg), send.data_ptr() if sum(send_rows) else None, send_bytes,
                             recv.data_ptr() if sum(recv_rows) else None, recv_bytes, error, len(error))
    if status:
        raise RuntimeError(error.value.decode(errors="replace"))


def _row_elements(tensor) -> int:
    elements = 1
    for size in tensor.shape[1:]:
        elements *= int(size)
    return elements


def exchange(pg, send_parts, recv_parts) -> None:
    """Rank ``p`` of ``pg`` receives ``send_parts[p]`` of every rank into its ``recv_parts``.

    ``send_parts[p]`` and ``recv_parts[p]`` are dense CPU tensors of one dtype; ``recv_parts``
    are written in place."""
    import paddle

    flat = [part.reshape([-1]) for part in send_parts]
    send = paddle.concat(flat) if flat else paddle.empty([0])
    recv = paddle.empty([sum(int(p.numel()) for p in recv_parts)], dtype=send.dtype)
    _exchange_rows(pg, send, [int(p.numel()) for p in send_parts], recv, [int(p.numel()) for p in recv_parts])
    start = 0
    for part in recv_parts:
        n = int(part.numel())
        if n:
            paddle.assign(recv[start:start + n].reshape(part.shape), output=part)
        start += n


# ---------------------------------------------------------------------------
# Paddle's arguments, checked as Paddle checks them
# ---------------------------------------------------------------------------

def split_sizes(sizes, rows: int, nranks: int, what: str) -> list:
    """Rows per rank along dim 0: ``sizes`` as given, or an equal split when it is empty."""
    sizes = [int(s) for s in (sizes or [])]
    if not sizes:
        if rows % nranks:
            raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all {what} has {rows} rows, which do "
                             f"not split evenly over {nranks} ranks; pass {what}_split_sizes.")
        return [rows // nranks] * nranks
    if len(sizes) != nranks:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all {what}_split_sizes has {len(sizes)} "
                         f"entries, the group has {nranks} ranks; give one size per rank.")
    if any(s < 0 for s in sizes):
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all {what}_split_sizes {sizes} has a "
                         "negative size.")
    if sum(sizes) != rows:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all {what}_split_sizes {sizes} sum to "
                         f"{sum(sizes)}, but the {what} tensor has {rows} rows along dim 0.")
    return sizes


def _row_parts(tensor, sizes):
    """Dense views of consecutive dim-0 blocks of ``tensor``."""
    parts, start = [], 0
    for size in sizes:
        parts.append(tensor[start:start + size].contiguous() if size else tensor[0:0])
        start += size
    return parts


def exchange_single(pg, out_tensor, in_tensor, out_sizes, in_sizes) -> None:
    """``all_to_all_single`` on gloo group ``pg``: dim-0 parts of ``in_tensor`` of sizes ``in_sizes``
    go to the ranks in order, parts of sizes ``out_sizes`` arrive into ``out_tensor`` (empty sizes:
    equal parts)."""
    import paddle

    nranks = pg.size()
    if out_tensor.dtype != in_tensor.dtype:
        raise TypeError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all input is {in_tensor.dtype}, output is "
                        f"{out_tensor.dtype}; they must match.")
    if list(out_tensor.shape[1:]) != list(in_tensor.shape[1:]):
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all input {list(in_tensor.shape)} and output "
                         f"{list(out_tensor.shape)} differ beyond dim 0.")
    in_sizes = split_sizes(in_sizes, in_tensor.shape[0], nranks, "in")
    out_sizes = split_sizes(out_sizes, out_tensor.shape[0], nranks, "out")
    with paddle.no_grad():
        send = in_tensor.contiguous()
        if out_tensor.is_contiguous():
            _exchange_rows(pg, send, in_sizes, out_tensor, out_sizes)
            return
        recv = paddle.empty(out_tensor.shape, dtype=out_tensor.dtype)
        _exchange_rows(pg, send, in_sizes, recv, out_sizes)
        paddle.assign(recv, output=out_tensor)


def _tensor_list(pg, out_list, in_list) -> None:
    import paddle

    nranks = pg.size()
    if len(in_list) != nranks:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all got {len(in_list)} input tensors for a "
                         f"group of {nranks} ranks; give one per rank.")
    if len(out_list) != nranks:
        raise ValueError(f"paddle_hybrid.dygraph.expert_parallel: all-to-all got {len(out_list)} output tensors for a "
                         f"group of {nranks} ranks; give one per rank (or an empty list).")
    with paddle.no_grad():
        send = [t.contiguous() for t in in_list]
        recv = [paddle.empty(t.shape, dtype=t.dtype) for t in out_list]
        exchange(pg, send, recv)
        for target, got in zip(out_list, recv):
            paddle.assign(got, output=target)


# ---------------------------------------------------------------------------
# the methods of ProcessGroupGloo
# ---------------------------------------------------------------------------

def _all_on_cpu(*tensors) -> bool:
    flat = []
    for t in tensors:
        flat.extend(t if isinstance(t, (list, tuple)) else [t])
    return all(on_cpu(t) for t in flat)


def _make(original, run, tensors_of):
    """A method that runs ``run(pg, *args)`` when every tensor is on the CPU, else Paddle's."""

    @functools.wraps(original)
    def method(self, *args):
        if not _all_on_cpu(*tensors_of(args)):
            return original(self, *args)
        run(self, *args)
        return DoneTask()

    return method


# name -> (what it does with (pg, *args), which arguments are tensors)
PATCHED_METHODS = {
    "all_to_all": (lambda pg, out, inp, sync_op: _tensor_list(pg, out, inp), lambda a: a[:2]),
    "all_to_all_on_calc_stream": (lambda pg, out, inp: _tensor_list(pg, out, inp), lambda a: a[:2]),
    "all_to_all_tensor": (lambda pg, out, inp, sync_op: exchange_single(pg, out, inp, [], []), lambda a: a[:2]),
    "all_to_all_tensor_on_calc_stream": (lambda pg, out, inp: exchange_single(pg, out, inp, [], []), lambda a: a[:2]),
    "all_to_all_single": (lambda pg, out, inp, o, i, sync_op: exchange_single(pg, out, inp, o, i), lambda a: a[:2]),
    "all_to_all_single_on_calc_stream": (lambda pg, out, inp, o, i: exchange_single(pg, out, inp, o, i), lambda a: a[:2]),
    "alltoall": (lambda pg, inp, out: exchange_single(pg, out, inp, [], []), lambda a: a[:2]),
    "alltoall_single": (lambda pg, inp, out, i, o: exchange_single(pg, out, inp, o, i), lambda a: a[:2]),
}


def apply(config, patcher) -> None:
    from paddle.base import core

    gloo = patcher.require(core, "ProcessGroupGloo", "paddle.base.core")
    originals = {name: patcher.require(gloo, name, "ProcessGroupGloo") for name in PATCHED_METHODS}
    for name in ("send", "recv", "all_gather", "scatter", "rank", "size"):
        patcher.require(gloo, name, "ProcessGroupGloo")
    for name, (run, tensors_of) in PATCHED_METHODS.items():
        patcher.set(gloo, name, _make(originals[name], run, tensors_of))
