"""A fake world beside the real one: this process is rank r of an N-rank job with no peer.

Why: a layout's memory and communication are decided per rank by the rank's own code (its
pipeline stage, its tensor-parallel shards, its sharding partition), at the job's real degrees and
sizes.  Stepping one rank of a 1024-rank job on one CPU needs every group of the job to exist and
every collective, point-to-point and barrier to answer at once, with tensors of the shapes the real
peers would give; :mod:`paddle_hybrid.dryrun` runs a script so, one rank at a time.

What it replaces, when ``PluginConfig.fake_world`` names a world file (the dry run writes it):

- ``core.create_or_get_global_tcp_store``: a store of this process only (a TCP store serving
  itself on loopback); a key no peer will ever set is awaited only until the plugin's deadline;
- ``collective._new_process_group_impl`` for gloo: a :class:`FakeProcessGroup` of the group's
  size, made at once (no rendezvous); :func:`paddle_hybrid.registry.device.is_gloo` answers for it as
  for gloo's, so every feature takes the path it takes on a real CPU job and cannot tell them apart.
- ``paddle.distributed.load_state_dict`` (a flex-checkpoint load: ``from_pretrained``, a Trainer's
  resume): no exchange and no weight read; the tensors the script built stay as they are, and the load
  is noted for the report (:mod:`.fake_checkpoint`).

Values (the shapes are always the real ones; the values are the fake world's):

- ``all_reduce`` / ``reduce``: this rank's tensor unchanged (as if every rank held the same and a
  sum were averaged back); ``all_gather`` (and ``gather`` at its destination): this rank's tensor in
  every slot; ``all_gather_partial``: this rank's part in every part; ``reduce_scatter``: this rank's
  slot of its input; ``all_to_all``: this rank's own part of its input in every part, as if every peer
  held what this rank holds (so an MoE count exchange of ranks that route alike returns what the real
  one does; the output keeps its size: the caller allocated it); ``scatter``: from this rank, its own
  slot, from another, as a broadcast;

The group answers every method of gloo's process group, under each of its names (``allreduce``
beside ``all_reduce``, the ``*_on_calc_stream`` forms): a call it lacked would raise inside
whatever called it, and Paddle drops an exception raised in a gradient hook it calls from C++ (fleet's
sequence-parallel hooks call ``allreduce``), so it surfaced later as another op's failure.

The log's bytes are those of the call's first tensor argument (Paddle's argument order: the output
first for ``*_into_tensor``, ``reduce_scatter`` and ``all_to_all``), as the probe logs a real run's;
- ``recv`` / ``broadcast`` from another rank: what that rank sent, when its run was recorded
  earlier in this dry run (the world file's ``replay`` directory: an integer tensor, such as a
  pipeline's meta message or the labels the first stage sends the last, carries its values up to
  :data:`KEPT_INTEGER_ELEMENTS` elements, a floating one up to :data:`KEPT_ELEMENTS`; a larger integer
  send, such as the bytes of the plugin's fused pipeline message, arrives as zeros, and so does a
  receive declared a payload (:func:`expect_payload`) from a rank not recorded); otherwise a
  floating tensor becomes ones and an integer tensor keeps this rank's values (a broadcast's source
  is assumed to hold what this rank holds).  An integer ``recv`` from a rank with no record is an error naming
  both: its values decide shapes, and guessing them would run another program than the real one.

Every call is logged (operation, the group's global ranks, bytes of this rank's tensor, in call
order); sends are recorded for the ranks run after this one.  The log and the records are written
at exit to the world file's ``out`` directory.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import socket

from ..common import exchange
from ..common.tensor_bytes import nbytes
from . import fake_checkpoint, fake_contexts
from .collectives import DoneTask

__all__ = ["FakeProcessGroup", "FakeWorldError", "KEPT_ELEMENTS", "apply", "active", "expect_payload", "log",
           "log_length", "is_fake"]

KEPT_ELEMENTS = 64  # float tensors up to this size carry their values into the record (losses, scales)
KEPT_INTEGER_ELEMENTS = 1 << 20  # integer tensors (pipeline meta, token ids, labels) carry theirs up to this

_STATE = {"world": None, "log": [], "sent": {}, "replay": {}, "pair_count": {}, "payloads": set()}


class FakeWorldError(AttributeError):
    """The fake world cannot answer a call the way the real one would (an AttributeError where a
    process group lacks a method, so ``hasattr`` keeps its meaning)."""


def active() -> bool:
    """Whether this process is in a fake world."""
    return _STATE["world"] is not None


def expect_payload(tensor) -> None:
    """The next receive into ``tensor`` carries bytes whose values decide no shape (the plugin's fused
    pipeline message: the shapes came in the stages' first exchange): from a sender that has not run,
    zeros arrive instead of the fake world's error for an integer receive without a record."""
    if active():
        _STATE["payloads"].add(id(tensor))


def is_fake(process_group) -> bool:
    return isinstance(process_group, FakeProcessGroup)


def log_length() -> int:
    """How many calls :func:`log` holds (without building it)."""
    return len(_STATE["log"]) + fake_contexts.count()


def log() -> list:
    """This process's communication so far, in call order: dicts of op, group (global ranks), bytes
    (and peer), of the Python process groups and the C++ comm contexts (:mod:`.fake_contexts`)."""
    return fake_contexts.merged(_STATE["log"])


def _is_float(tensor) -> bool:
    import paddle

    return tensor.dtype in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)


class FakeProcessGroup:
    """A process group of ``size`` ranks whose peers answer at once (see the module docstring)."""

    def __init__(self, rank: int, size: int, gid: int, ranks):
        self._rank, self._size, self._gid = rank, size, gid
        self._ranks = list(ranks) if ranks is not None else None

    # -- what Paddle asks of a process group
    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def name(self):
        return "FakeGloo"

    @property
    def id(self):
        return self._gid

    def _global(self, local: int) -> int:
        return self._ranks[local] if self._ranks is not None else local

    def _record(self, op: str, tensor, **extra) -> None:
        entry = {"op": op, "group": self._ranks, "bytes": nbytes(tensor) if tensor is not None else 0,
                 "seq": fake_contexts.next_seq()}
        entry.update(extra)
        _STATE["log"].append(entry)

    # -- collectives
    def all_reduce(self, tensor, op=None, sync_op=True, *args, **kwargs):
        self._record("all_reduce", tensor)
        return DoneTask()

    all_reduce_on_calc_stream = all_reduce
    # gloo's older name (no sync_op), which fleet's sequence-parallel gradient hooks call
    allreduce = all_reduce

    def reduce(self, tensor, dst, op=None, sync_op=True, *args, **kwargs):
        self._record("reduce", tensor)
        return DoneTask()

    reduce_on_calc_stream = reduce

    def broadcast(self, tensor, src, sync_op=True, *args, **kwargs):
        self._record("broadcast", tensor)
        if src != self._rank:
            _fill_from(tensor, self._global(src), _world()["rank"], "broadcast")
        return DoneTask()

    broadcast_on_calc_stream = broadcast

    def barrier(self, *args, **kwargs):
        _STATE["log"].append({"op": "barrier", "group": self._ranks, "bytes": 0, "seq": fake_contexts.next_seq()})
        return DoneTask()

    def all_gather(self, first, second, *args, **kwargs):
        # Paddle's overloads: (input, output tensor) and (output list, input)
        if isinstance(first, list):
            return self._gather_list(first, second)
        self._record("all_gather", first)
        _tile(second, first, self._size)
        return DoneTask()

    def all_gather_on_calc_stream(self, first, second, *args, **kwargs):  # (output list or tensor, input)
        if isinstance(first, list):
            return self._gather_list(first, second)
        return self.all_gather_into_tensor(first, second)

    def _gather_list(self, out_list, tensor):
        self._record("all_gather", tensor)
        _fill_list(out_list, tensor, self._size)
        return DoneTask()

    def all_gather_into_tensor(self, out, tensor, *args, **kwargs):
        self._record("all_gather", out)
        _tile(out, tensor, self._size)
        return DoneTask()

    all_gather_into_tensor_on_calc_stream = all_gather_into_tensor

    def reduce_scatter(self, out, tensor, op=None, sync_op=True, *args, **kwargs):
        self._record("reduce_scatter", out)
        _own_slot(out, tensor, self._rank, self._size)
        return DoneTask()

    reduce_scatter_tensor = reduce_scatter
    reduce_scatter_tensor_on_calc_stream = reduce_scatter
    reduce_scatter_on_calc_stream = reduce_scatter

    def all_to_all(self, out, tensor, *args, **kwargs):
        self._record("all_to_all", out)
        _own_part_everywhere(out, tensor, self._rank, self._size)
        return DoneTask()

    all_to_all_tensor = all_to_all
    all_to_all_on_calc_stream = all_to_all
    all_to_all_tensor_on_calc_stream = all_to_all

    def all_to_all_single(self, out, tensor, out_sizes=None, in_sizes=None, *args, **kwargs):
        self._record("all_to_all", out)
        _own_part_everywhere(out, tensor, self._rank, self._size, in_sizes)
        return DoneTask()

    all_to_all_single_on_calc_stream = all_to_all_single

    def alltoall(self, tensor, out, *args, **kwargs):  # (input, output), as Paddle's
        self._record("all_to_all", tensor)
        _own_part_everywhere(out, tensor, self._rank, self._size)
        return DoneTask()

    alltoall_single = alltoall

    def all_gather_partial(self, out, tensor, num, part, *args, **kwargs):
        """Fleet's pipeline gathers ``out`` (split in ``num`` parts) from each rank's part: part ``part``
        of this rank's ``tensor`` in every part."""
        self._record("all_gather", out)
        _tile_part(out, tensor, num, part)
        return DoneTask()

    all_gather_partial_on_calc_stream = all_gather_partial

    def gather(self, tensor, out_list, dst, *args, **kwargs):  # (input, output list), as Paddle's
        self._record("gather", tensor)
        if dst == self._rank:
            _fill_list(out_list, tensor, self._size)
        return DoneTask()

    def scatter(self, out, tensors, src, *args, **kwargs):  # (output, input list or tensor), as Paddle's
        self._record("scatter", out)
        if src == self._rank:
            _own_slot(out, _joined(tensors), self._rank, self._size)
        else:
            _fill_from(out, self._global(src), _world()["rank"], "scatter")
        return DoneTask()

    scatter_on_calc_stream = scatter
    scatter_tensor = scatter
    scatter_tensor_on_calc_stream = scatter

    def eager_connect(self, *args, **kwargs):
        """Nothing to connect: no peer."""

    eager_connect_ring_exchange = eager_connect

    # -- point to point
    def send(self, tensor, dst, sync_op=True, *args, **kwargs):
        peer = self._global(dst)
        self._record("send", tensor, peer=peer)
        _keep_sent(tensor, _world()["rank"], peer)
        return DoneTask()

    send_on_calc_stream = send
    send_partial = send
    send_partial_on_calc_stream = send

    def recv(self, tensor, src, sync_op=True, *args, **kwargs):
        peer = self._global(src)
        self._record("recv", tensor, peer=peer)
        _fill_from(tensor, peer, _world()["rank"], "recv")
        return DoneTask()

    recv_on_calc_stream = recv
    recv_partial = recv
    recv_partial_on_calc_stream = recv

    def __getattr__(self, name):
        raise FakeWorldError(
            f"paddle_hybrid.dryrun: the fake world's process group has no {name!r}; the script called a collective "
            "the dry run does not answer yet. Run the layout for real (python -m paddle_hybrid.launch) or report it.")


# --------------------------------------------------------------------------- values


def _tile(out, tensor, n: int) -> None:
    import paddle

    if int(out._numel()) != int(tensor._numel()) * n:
        raise FakeWorldError(f"all_gather: output of {int(out._numel())} elements for {n} x {int(tensor._numel())}")
    with paddle.no_grad():
        paddle.assign(paddle.concat([tensor.reshape([-1])] * n).reshape(out.shape).astype(out.dtype), output=out)


def _fill_list(out_list, tensor, n: int) -> None:
    """Paddle's C++ fills the caller's list (empty, or one tensor per rank) with one tensor per rank."""
    del out_list[:]
    out_list.extend(tensor.clone() for _ in range(n))


def _joined(tensors):
    import paddle

    return paddle.concat([t.reshape([-1]) for t in tensors]) if isinstance(tensors, (list, tuple)) else tensors


def _tile_part(out, tensor, num: int, part: int) -> None:
    import paddle

    size = int(out._numel()) // num
    if size * num != int(out._numel()) or int(tensor._numel()) != int(out._numel()):
        raise FakeWorldError(f"all_gather_partial: {int(out._numel())} elements in {num} parts, an input of "
                             f"{int(tensor._numel())}")
    with paddle.no_grad():
        piece = tensor.reshape([-1])[part * size:(part + 1) * size]
        paddle.assign(paddle.concat([piece] * num).reshape(out.shape).astype(out.dtype), output=out)


def _own_slot(out, tensor, rank: int, n: int) -> None:
    import paddle

    size = int(out._numel())
    if size * n != int(tensor._numel()):
        raise FakeWorldError(f"reduce_scatter: output of {size} elements for an input of {int(tensor._numel())}")
    with paddle.no_grad():
        paddle.assign(tensor.reshape([-1])[rank * size:(rank + 1) * size].reshape(out.shape), output=out)


def _own_part_everywhere(out, tensor, rank: int, n: int, in_sizes=None) -> None:
    """Part ``rank`` of ``tensor`` (dim-0 parts of ``in_sizes`` rows, or ``n`` equal parts) in every part
    of ``out``; an output that is not a whole number of such parts (sizes no alike peers would send)
    gets the input's first elements."""
    import paddle

    rows = int(tensor.shape[0]) if tensor.shape else 0
    sizes = [int(s) for s in in_sizes] if in_sizes else [rows // n] * n
    part = tensor[sum(sizes[:rank]):sum(sizes[:rank + 1])].reshape([-1]) if len(sizes) == n else None
    if part is None or sum(sizes) != rows or int(part._numel()) == 0 or int(out._numel()) % int(part._numel()):
        _copy_prefix(out, tensor)
        return
    with paddle.no_grad():
        copies = int(out._numel()) // int(part._numel())
        paddle.assign(paddle.concat([part] * copies).reshape(out.shape).astype(out.dtype), output=out)


def _copy_prefix(out, tensor) -> None:
    import paddle

    n = min(int(out._numel()), int(tensor._numel()))
    if n == 0:
        return
    with paddle.no_grad():
        flat = out.reshape([-1])
        flat[:n] = tensor.reshape([-1])[:n].astype(out.dtype)


def _keep_sent(tensor, me: int, peer: int) -> None:
    """A send's shape, dtype and (small tensors) values, for the run of ``peer`` after this one."""
    key = (me, peer)
    index = _STATE["pair_count"].get(("send",) + key, 0)
    _STATE["pair_count"][("send",) + key] = index + 1
    entry = {"shape": list(tensor.shape), "dtype": str(tensor.dtype)}
    limit = KEPT_ELEMENTS if _is_float(tensor) else KEPT_INTEGER_ELEMENTS
    if int(tensor._numel()) <= limit:
        entry["values"] = tensor.numpy().reshape(-1).tolist()
    _STATE["sent"].setdefault(f"{me}->{peer}", []).append(entry)


def _fill_from(tensor, source: int, me: int, op: str) -> None:
    """``tensor`` as received from ``source`` (see the module docstring)."""
    import numpy as np
    import paddle

    counter = (op, source, me)
    index = _STATE["pair_count"].get(counter, 0)
    _STATE["pair_count"][counter] = index + 1
    recorded = _STATE["replay"].get(f"{source}->{me}") if op == "recv" else None
    payload = id(tensor) in _STATE["payloads"]
    _STATE["payloads"].discard(id(tensor))
    entry = recorded[index] if recorded is not None and index < len(recorded) else None
    with paddle.no_grad():
        if entry is not None and "values" in entry:
            values = np.asarray(entry["values"]).reshape(tensor.shape).astype(tensor.numpy().dtype)
            tensor.copy_(paddle.to_tensor(values), False)
        elif _is_float(tensor):
            tensor.copy_(paddle.ones(tensor.shape, tensor.dtype), False)
        elif entry is not None or payload:
            # sent, too large to keep, or declared a payload (a fused message's bytes): not a shape
            tensor.copy_(paddle.zeros(tensor.shape, tensor.dtype), False)
        elif op == "recv":
            raise FakeWorldError(
                f"paddle_hybrid.dryrun: rank {me} receives an integer tensor {list(tensor.shape)} from rank {source}, "
                "whose run was not recorded before this one; its values decide shapes. Dry-run rank "
                f"{source}'s class first (pipeline stages in order) or with --ranks all.")
        # an integer broadcast keeps this rank's values (its source is assumed to hold the same)


# --------------------------------------------------------------------------- install


def _world() -> dict:
    return _STATE["world"]


def _load(path: str) -> dict:
    with open(path) as f:
        world = json.load(f)
    for key in ("rank", "world_size", "out"):
        if key not in world:
            raise FakeWorldError(f"paddle_hybrid: the fake world file {path} has no {key!r}")
    return world


def _replay(world) -> dict:
    """Sends recorded by earlier runs of this dry run that reach this rank: {"src->dst": [entries]}."""
    found = {}
    folder = world.get("replay")
    if not folder or not os.path.isdir(folder):
        return found
    me = world["rank"]
    for name in sorted(os.listdir(folder)):
        if name.startswith("sent.") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                for pair, entries in json.load(f).items():
                    if pair.endswith(f"->{me}"):
                        found[pair] = entries
    return found


def _replay_cpp(world) -> list:
    """What earlier runs sent on C++ comm contexts (every pair: a pair names its receiver within
    the context, and only a rank that receives on it asks)."""
    folder, found = world.get("replay"), []
    if not folder or not os.path.isdir(folder):
        return found
    for name in sorted(os.listdir(folder)):
        if name.startswith("sent_cpp.") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                found.extend(json.load(f))
    return found


def _write() -> None:
    world = _world()
    os.makedirs(world["out"], exist_ok=True)
    rank = world["rank"]
    with open(os.path.join(world["out"], f"comm.{rank}.json"), "w") as f:
        json.dump(log(), f)
    with open(os.path.join(world["out"], f"sent.{rank}.json"), "w") as f:
        json.dump(_STATE["sent"], f)
    with open(os.path.join(world["out"], f"sent_cpp.{rank}.json"), "w") as f:
        json.dump(fake_contexts.sent(), f)
    with open(os.path.join(world["out"], f"assumed_cpp.{rank}.json"), "w") as f:
        json.dump(fake_contexts.assumed(), f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ReducerGroup:
    """What ``paddle.DataParallel.init_reducer`` reads of its group: ``process_group``."""

    def __init__(self, process_group):
        self.process_group = process_group


def _make_init_reducer(stock, get_store):
    """``paddle.DataParallel``'s C++ reducer takes a C++ process group: in a fake world it gets a real gloo
    group of this rank alone (its all-reduce leaves this rank's gradient, as the fake world's does, and
    waits on no peer).  Its calls are made in C++, so neither a dry run nor a real run's probe logs them."""
    lone = {}

    @functools.wraps(stock)
    def init_reducer(self, *args, **kwargs):
        from paddle.base import core

        if "pg" not in lone:
            lone["pg"] = core.ProcessGroupGloo.create(get_store(), 0, 1, _LONE_GROUP_ID)
        group = self.group
        self.group = _ReducerGroup(lone["pg"])
        try:
            return stock(self, *args, **kwargs)
        finally:
            self.group = group

    return init_reducer


_LONE_GROUP_ID = 2**30  # far from the ids Paddle gives its groups


def _make_store(timeout: float):
    from paddle.base import core

    return core.TCPStore("127.0.0.1", _free_port(), True, 1, max(1, int(timeout)))


def _make_new_pg_impl(orig_impl):
    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *args,
                                **kwargs):
        if backend != "gloo":
            return orig_impl(backend, store, rank, world_size, group_name, pg_options, group_id, *args, **kwargs)
        from .groups import _members_being_created

        members = _members_being_created(world_size)
        if members is None and world_size == _world()["world_size"]:
            members = list(range(world_size))
        return FakeProcessGroup(rank, world_size, group_id, members)

    return _new_process_group_impl


def apply(config, patcher) -> None:
    """With ``config.fake_world`` (a world file), this process becomes its rank of a world with no peer."""
    if not config.fake_world:
        return
    import paddle.distributed.collective as collective
    import paddle.distributed.parallel as parallel
    from paddle.base import core

    world = _load(config.fake_world)
    _STATE.update(world=world, log=[], sent={}, pair_count={}, replay=_replay(world))
    store = {}

    def create_or_get_global_tcp_store():
        if "store" not in store:
            store["store"] = _make_store(config.timeout)
        return store["store"]

    patcher.set(core, "create_or_get_global_tcp_store", create_or_get_global_tcp_store)
    # The C++ paths' groups (the semi-auto API, static programs) and their global store.
    fake_contexts.apply(patcher, fake=True, store_port=_free_port(), timeout=config.timeout)
    fake_contexts.replay(_replay_cpp(world))
    exchange.answer_for_every_rank(True)
    patcher.on_revert(lambda: exchange.answer_for_every_rank(False), "the plugin's exchanges answered alone")
    import paddle

    patcher.set(paddle.DataParallel, "init_reducer",
                _make_init_reducer(patcher.require(paddle.DataParallel, "init_reducer", "paddle.DataParallel"),
                                   create_or_get_global_tcp_store))
    impl = _make_new_pg_impl(collective._new_process_group_impl)
    patcher.set(collective, "_new_process_group_impl", impl)
    patcher.set(parallel, "_new_process_group_impl", impl)
    # A flex-checkpoint load is an exchange of every rank's requests: here it reads nothing and leaves the
    # tensors the script built as they are (what is measured needs no weight).
    fake_checkpoint.apply(patcher, active)
    atexit.register(_write)
    patcher.on_revert(lambda: atexit.unregister(_write), "the fake world's record at exit")
