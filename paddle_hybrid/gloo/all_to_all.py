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

**How the bytes move: a pairwise exchange.**  Each byte crosses the wire once, from its
sender to its receiver, over the group's own gloo pairs; nothing is gathered everywhere.
Gloo tags every operation of a process group with one counter per group, incremented by
every send and every recv, and a recv only matches a send of the same tag.  So the exchange
is organised in rounds in which every rank does exactly two operations with exactly one
partner: for an even group size a round-robin schedule (the "circle method": ``n - 1``
rounds, each a perfect matching), the lower rank of a pair sending first and the higher
receiving first.  Both ranks of a pair then use the same two tags, and no rank waits on a
rank that waits on someone else.  A part with no rows is still exchanged, as one dummy
element, so that every rank's counter advances alike.  For an odd group size no perfect
matching exists (some rank would idle a round and fall out of step); there, each rank in
turn scatters its parts, padded to the largest part it sends (an all-gather of the split
sizes first: ``n`` integers a rank).

Per call, the device rule: a tensor that is not in host memory goes to Paddle's original
method unchanged (which refuses it, as before); groups of another backend never reach this
module, since only ``ProcessGroupGloo`` is patched.  Gloo's operations complete inside the
call, so ``sync_op=False`` returns a task that is already complete; ``wait()`` returns at once.
"""
from __future__ import annotations

import functools

from ..registry.device import on_cpu
from .collectives import DoneTask

__all__ = ["apply", "PATCHED_METHODS", "round_robin_partner", "exchange", "exchange_single", "split_sizes"]


# ---------------------------------------------------------------------------
# the schedule
# ---------------------------------------------------------------------------

def round_robin_partner(rank: int, round_index: int, nranks: int) -> int:
    """Partner of ``rank`` in round ``round_index`` (0 .. nranks - 2) of the circle method for an
    even ``nranks``: rank ``nranks - 1`` stays put, the others rotate.  Every round pairs every
    rank with exactly one other, and over the rounds every pair meets once."""
    if nranks % 2:
        raise ValueError(f"round_robin_partner needs an even group size, got {nranks}")
    last = nranks - 1
    if rank == last:
        return round_index
    if rank == round_index:
        return last
    return (2 * round_index - rank) % last


# ---------------------------------------------------------------------------
# the exchange
# ---------------------------------------------------------------------------

def _placeholder(like):
    import paddle

    return paddle.zeros([1], dtype=like.dtype)


def _pair_exchange(pg, me, peer, send, recv) -> None:
    """One round with one partner: two operations, the lower rank sending first."""
    send = send if send.numel() > 0 else _placeholder(send)
    target = recv if recv.numel() > 0 else _placeholder(recv)
    if me < peer:
        pg.send(send, peer, True)
        pg.recv(target, peer, True)
    else:
        pg.recv(target, peer, True)
        pg.send(send, peer, True)


def _scatter_rounds(pg, me, nranks, send_parts, recv_parts) -> None:
    """Odd group sizes: rank ``root`` scatters its parts, each padded to the largest it sends."""
    import paddle

    sizes = paddle.to_tensor([int(p.numel()) for p in send_parts], dtype="int64")
    gathered = paddle.empty([nranks * nranks], dtype="int64")
    pg.all_gather(gathered, sizes, True).wait()
    table = gathered.numpy().reshape(nranks, nranks)  # table[root][dest] = elements root sends dest
    dtype = send_parts[0].dtype
    for root in range(nranks):
        width = max(1, int(table[root].max()))
        received = paddle.empty([width], dtype=dtype)
        if root == me:
            padded = paddle.zeros([nranks * width], dtype=dtype)
            for dest, part in enumerate(send_parts):
                n = int(part.numel())
                if n:
                    padded[dest * width:dest * width + n] = part.reshape([-1])
        else:
            padded = paddle.empty([nranks * width], dtype=dtype)  # only the root's input is read
        pg.scatter(received, padded, root, True).wait()
        n = int(table[root][me])
        if root != me and n:
            paddle.assign(received[:n].reshape(recv_parts[root].shape), output=recv_parts[root])


def exchange(pg, send_parts, recv_parts) -> None:
    """Rank ``p`` of ``pg`` receives ``send_parts[p]`` of every rank into its ``recv_parts``.

    ``send_parts[p]`` and ``recv_parts[p]`` are dense CPU tensors of one dtype; ``recv_parts``
    are written in place (the own part is a copy)."""
    import paddle

    nranks, me = pg.size(), pg.rank()
    if send_parts[me].numel() > 0:
        paddle.assign(send_parts[me].reshape(recv_parts[me].shape), output=recv_parts[me])
    if nranks == 1:
        return
    if nranks % 2:
        _scatter_rounds(pg, me, nranks, send_parts, recv_parts)
        return
    for round_index in range(nranks - 1):
        peer = round_robin_partner(me, round_index, nranks)
        _pair_exchange(pg, me, peer, send_parts[peer], recv_parts[peer])


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
    send = _row_parts(in_tensor, in_sizes)
    row_shape = list(out_tensor.shape[1:])
    recv = [paddle.empty([size] + row_shape, dtype=out_tensor.dtype) for size in out_sizes]
    with paddle.no_grad():
        exchange(pg, send, recv)
        paddle.assign(paddle.concat(recv, axis=0) if recv else out_tensor, output=out_tensor)


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
