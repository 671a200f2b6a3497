"""What a section program becomes to execute on CPU over gloo, op for op.

The section program that fleet built (and the send-wait pass rewrote) is left as it is: it is
what :func:`paddle_hybrid.static.send_wait.check_send_lifetimes` checks.  A copy is lowered:

* ``send_v2`` / ``recv_v2`` (their CPU kernels only throw) become ``py_func`` ops calling
  :func:`send` / :func:`recv`, a real point-to-point message on the ring's gloo process group
  (:mod:`paddle_hybrid.gloo.rings`: ``ProcessGroupGloo.send``/``recv`` to the ring rank the op names as ``peer``),
  at the op's place in the program.  A recv allocates what it receives from its ``out_shape`` and
  ``dtype`` and returns once it arrived.  A send is queued on the ring's sender thread, the CPU
  stand-in for the communication stream (:class:`_Sender`); one with ``use_calc_stream=True``
  then waits until the peer received it.
* ``c_sync_comm_stream`` (no CPU kernel) becomes a ``py_func`` waiting for the ring's queued sends;
  ``c_sync_calc_stream`` is dropped (gloo reads the data as it is; there is no calculation stream).
* everything else, the send-wait keep-alives ``ph_nop`` included, is kept.

Why ``py_func`` over the ring's process group and not the alternatives:

* custom ``ph_send``/``ph_recv`` C++ ops over the ring's gloo comm context: in Paddle 3.3.1
  ``GlooCommContext::Send/Recv`` and ``CommContextManager::Get`` are not exported from
  ``libpaddle.so``, so a custom op cannot reach a context;
* a rewrite to an existing CPU collective (``broadcast`` on the 2-rank ring, rooted at the
  sender): legacy collective ops on CPU all get the first ring's comm context (see
  :mod:`paddle_hybrid.gloo.rings`), so with two or more rings per process messages go to the wrong peer.  Seen:
  stage 0's gradients arrived as its own zeros, and 1F1B paired the wrong micro-batches.
"""
from __future__ import annotations

import queue
import threading

import numpy as np
from paddle.base import framework

from ...common.program_edit import OP_DEVICE_KEY, OP_ROLE_KEY, deferred_sync, op_role
from ...gloo.rings import DEADLINE_SETTING, RingTimeoutError, ring

__all__ = ["lower_for_gloo", "send", "recv", "wait_sends", "drain_all", "take_failure"]


def _dygraph():
    """Eager tensors (what a process group sends) exist only in dygraph mode, which is
    thread-local; the callbacks run inside a static executor, the sends in a sender thread."""
    import paddle

    return paddle.base.dygraph.guard(paddle.CPUPlace())


class _Sender:
    """The communication stream of one ring: sends in order on a thread of their own.

    A gloo send returns only once the peer received, so two neighbours that both send before
    they receive (1F1B's steady state: stage s sends activation i + 1 while stage s + 1 sends
    gradient i) would wait for each other forever if the executor sent itself.  Each send takes a
    copy of its data, so nothing the executor frees later can change what is sent.
    """

    def __init__(self, ring_id: int):
        self.ring_id = ring_id
        self.queue: queue.Queue = queue.Queue()
        self.pending = 0
        self.error = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=f"ph-pipeline-send-ring{ring_id}", daemon=True)
        self.thread.start()

    def _loop(self):
        import paddle

        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            array, peer = item
            try:
                if self.error is None:
                    with _dygraph():
                        ring(self.ring_id).group.send(paddle.to_tensor(array), peer, True).wait()
            except BaseException as exc:  # reported by the next submit or drain
                self.error = exc
            with self.cond:
                self.pending -= 1
                self.cond.notify_all()

    def submit(self, array, peer: int) -> None:
        self._raise()
        with self.cond:
            self.pending += 1
        self.queue.put((array, peer))

    def drain(self, timeout: float) -> None:
        """Wait until every submitted send completed (what ``c_sync_comm_stream`` waits for)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.pending == 0, timeout):
                raise RingTimeoutError(
                    f"paddle_hybrid.static.static_pipeline: {ring(self.ring_id).describe()}: {self.pending} send(s) not "
                    f"received by the peer within {timeout:.0f} s, the deadline of {DEADLINE_SETTING} (is every stage "
                    "running the same steps?)")
        self._raise()

    def stop(self, timeout: float) -> bool:
        """End the thread once the sends queued before are done (or failed); True if it ended
        within ``timeout`` seconds."""
        self.queue.put(_STOP)
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _raise(self):
        if self.error is not None:
            raise RuntimeError(f"paddle_hybrid.static.static_pipeline: a send on {ring(self.ring_id).describe()} "
                               f"failed: {self.error}") from self.error


_STOP = object()  # queued by _Sender.stop: the thread's last item
_senders: dict = {}  # ring id -> _Sender


def _sender(ring_id: int) -> _Sender:
    if ring_id not in _senders:
        _senders[ring_id] = _Sender(ring_id)
    return _senders[ring_id]


def send(ring_id: int, peer: int, tensor, wait: bool, timeout: float) -> None:
    """Queue a copy of ``tensor`` (a DenseTensor) for ring rank ``peer`` of ring ``ring_id``;
    with ``wait`` (a send on the calculation stream) return only once it was received, within
    ``timeout`` seconds."""
    sender = _sender(ring_id)
    sender.submit(np.array(tensor), peer)
    if wait:
        sender.drain(timeout)


def wait_sends(ring_id: int, timeout: float) -> None:
    """``c_sync_comm_stream`` of ring ``ring_id``: wait (``timeout`` seconds at most) for every
    queued send of the ring."""
    _sender(ring_id).drain(timeout)


def shutdown(timeout: float = 10.0) -> None:
    """Stop every sender thread (at uninstall); forget their errors and a callback's failure."""
    stuck = [ring_id for ring_id, sender in list(_senders.items()) if not sender.stop(timeout)]
    _senders.clear()
    _failure[0] = None
    if stuck:
        import warnings

        warnings.warn(f"paddle_hybrid.static.static_pipeline: the sender threads of rings {stuck} are still blocked in "
                      f"a send after {timeout:.0f} s; they end with the process.", RuntimeWarning, stacklevel=2)


def drain_all(timeout: float) -> None:
    """Every ring's sends completed (the end of a step), each ring within ``timeout`` seconds."""
    for sender in list(_senders.values()):
        sender.drain(timeout)


def recv(ring_id: int, peer: int, shape, dtype):
    """Receive an array of ``shape``/``dtype`` from ring rank ``peer`` of ring ``ring_id``."""
    import paddle

    info = ring(ring_id)
    with _dygraph():
        t = paddle.zeros(shape, dtype=dtype)
        try:
            info.group.recv(t, peer, True).wait()
        except Exception as exc:  # gloo's timeout names no ring
            raise RingTimeoutError(f"paddle_hybrid.static.static_pipeline: {info.describe()}: receiving from ring rank "
                                   f"{peer} failed ({DEADLINE_SETTING} bounds the wait): {exc}") from exc
        return t.numpy()


_failure: list = [None]  # the last exception of a callback: py_func reports only "std::exception"


def take_failure():
    """The exception a p2p callback raised in the last executor run (once), or None."""
    failure, _failure[0] = _failure[0], None
    return failure


def _reported(fn):
    """``fn`` for a py_func op: an exception is kept for :func:`take_failure` before it crosses
    into C++, where its message would be lost."""

    def call(*args):
        try:
            return fn(*args)
        except BaseException as exc:
            _failure[0] = exc
            raise

    return call


def _attrs(op) -> dict:
    attrs = {OP_ROLE_KEY: op_role(op)}
    if op.has_attr(OP_DEVICE_KEY):
        attrs[OP_DEVICE_KEY] = op.attr(OP_DEVICE_KEY)
    return attrs


def _py_func_attrs(op, fn) -> dict:
    from paddle.static.nn.common import PyFuncRegistry

    registry = PyFuncRegistry(_reported(fn))  # Paddle keeps the registry (and fn) for the process's life
    return dict(_attrs(op), forward_callable_id=registry.id, backward_callable_id=-1, backward_skip_vars=[])


def _lower_send(block, idx, op, timeout: float) -> None:
    name, ring_id, peer = op.input("X")[0], op.attr("ring_id"), op.attr("peer")
    ring(ring_id)  # fails here, naming the fix, if the ring is unknown
    wait = bool(op.attr("use_calc_stream")) if op.has_attr("use_calc_stream") else True
    attrs = _py_func_attrs(op, lambda x: send(ring_id, peer, x, wait, timeout))
    block._remove_op(idx)
    block._insert_op(idx, type="py_func", inputs={"X": [name]}, outputs={"Out": []}, attrs=attrs)


def _lower_recv(block, idx, op) -> None:
    from paddle.base.data_feeder import convert_dtype

    name, ring_id, peer = op.output("Out")[0], op.attr("ring_id"), op.attr("peer")
    ring(ring_id)
    shape, dtype = list(op.attr("out_shape")), convert_dtype(block.var(name).dtype)
    attrs = _py_func_attrs(op, lambda: recv(ring_id, peer, shape, dtype))
    block._remove_op(idx)
    block._insert_op(idx, type="py_func", inputs={"X": []}, outputs={"Out": [name]}, attrs=attrs)


def _lower_comm_sync(block, idx, op, timeout: float) -> None:
    ring_id, names = op.attr("ring_id"), op.input("X")
    attrs = _py_func_attrs(op, lambda *xs: wait_sends(ring_id, timeout))
    block._remove_op(idx)
    block._insert_op(idx, type="py_func", inputs={"X": names}, outputs={"Out": []}, attrs=attrs)


def lower_for_gloo(section, timeout: float) -> framework.Program:
    """A lowered copy of ``section`` (see the module doc), whose sends wait at most ``timeout``
    seconds for their peer; ``section`` is not changed."""
    program = section.clone()
    block = program.global_block()
    with deferred_sync(block):
        idx = 0
        while idx < len(block.ops):
            op = block.ops[idx]
            if op.type == "c_sync_calc_stream":
                block._remove_op(idx)  # gloo works on the data as it is: nothing to wait for
                continue
            if op.type in ("partial_send", "partial_recv", "partial_allgather"):
                raise NotImplementedError(
                    f"paddle_hybrid.static.static_pipeline: {op.type} (pipeline with tensor parallel) is not lowered for gloo.")
            if op.type == "send_v2":
                _lower_send(block, idx, op, timeout)
            elif op.type == "recv_v2":
                _lower_recv(block, idx, op)
            elif op.type == "c_sync_comm_stream":
                _lower_comm_sync(block, idx, op, timeout)
            idx += 1
    return program
