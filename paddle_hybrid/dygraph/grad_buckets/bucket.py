"""The data of gradient buckets: how parameters are grouped, and one bucket's fused buffer
with a view of it per parameter.

A :class:`Bucket` owns one contiguous buffer made with the plugin's ``coalesce_tensor`` (the
built-in's layout, 64-byte aligned views) and one view per parameter.  It never hands its
views out: each parameter gets an *alias*, a separate tensor sharing the view's memory, as
its gradient (``param.grad``, or ``param.main_grad`` with fleet's main_grad recipe).  So
whatever happens to a parameter's gradient tensor (``_clear()``, a new tensor assigned, a
"fake empty" grad that Paddle replaces on the next backward) cannot damage the buffer, and
:meth:`Bucket.rebind` puts such a parameter back, keeping its current values.

Nothing here talks to other ranks or knows about hooks; that is :mod:`.sync`.
"""
from __future__ import annotations

import paddle

from ... import ops
from ...common import grad_tools

__all__ = ["ALIGN_BYTES", "Bucket", "plan_buckets", "grad_nbytes"]

ALIGN_BYTES = 64
"""Each view starts on a cache line; the padding between parameters stays small."""

MAIN_GRAD_DTYPE = "float32"


def grad_nbytes(param, main_grad: bool = False) -> int:
    """Bytes of ``param``'s gradient in a bucket (fp32 when the bucket holds ``main_grad``)."""
    itemsize = 4 if main_grad else param.element_size()
    return int(param._numel()) * itemsize


def plan_buckets(params, bucket_bytes: int, max_params: int = 0, main_grad: bool = False) -> list[list]:
    """Split ``params`` into buckets, in reverse order: backward produces the last layers'
    gradients first, so the first bucket fills first.

    A bucket holds one dtype, at most ``bucket_bytes`` bytes of gradients and, when
    ``max_params > 0``, at most ``max_params`` parameters; a parameter larger than
    ``bucket_bytes`` gets a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes must be > 0, got {bucket_bytes}.")
    if max_params < 0:
        raise ValueError(f"plan_buckets: max_params must be >= 0 (0: no limit), got {max_params}.")
    buckets, cur, cur_bytes = [], [], 0
    for p in reversed(list(params)):
        size = grad_nbytes(p, main_grad)
        full = cur and ((not main_grad and cur[0].dtype != p.dtype) or cur_bytes + size > bucket_bytes
                        or (max_params and len(cur) >= max_params))
        if full:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += size
    if cur:
        buckets.append(cur)
    return buckets


class Bucket:
    """One fused gradient buffer; parameter ``params[i]``'s gradient aliases ``views[i]``.

    Args:
        index: position of the bucket in its set (the order every rank starts them in).
        params: the parameters, in buffer order.
        main_grad: hold ``param.main_grad`` (fp32) instead of ``param.grad``.
    """

    def __init__(self, index: int, params, main_grad: bool = False):
        self.index = index
        self.params = list(params)
        self.main_grad = main_grad
        with paddle.no_grad():
            # Seeds carry each parameter's current gradient into the buffer; they become the
            # bucket's own views (coalesce turns its inputs into views).
            seeds = [self._seed(p) for p in self.params]
            self.views, self.buffer = ops.coalesce_tensor(seeds, copy_data=True, use_align=True,
                                                          align_size=ALIGN_BYTES)
            for i in range(len(self.params)):
                self._alias(i)
        self.nbytes = int(self.buffer._numel()) * self.buffer.element_size()
        self._ptrs = [v.data_ptr() for v in self.views]  # the bucket's own views never move

    # -- what a parameter's gradient is -----------------------------------------------
    def _current(self, p):
        """The parameter's gradient tensor as Paddle or the main_grad recipe sees it (or None)."""
        return grad_tools.current_grad(p, self.main_grad)

    def _seed(self, p):
        g = self._current(p)
        dtype = MAIN_GRAD_DTYPE if self.main_grad else p.dtype
        return paddle.zeros(p.shape, dtype) if g is None else g.astype(dtype).clone()

    def _alias(self, i: int) -> None:
        """Make parameter ``i``'s gradient a tensor that shares ``views[i]``'s memory."""
        p, view = self.params[i], self.views[i]
        if self.main_grad:
            alias = paddle.empty_like(view)
            view._share_buffer_to(alias)
            p.main_grad = alias
        else:
            p._set_grad_ivar(paddle.empty_like(view))  # a grad tensor of the right meta ...
            view._share_buffer_to(p._grad_ivar())      # ... then pointed into the buffer

    def is_bound(self, i: int) -> bool:
        return grad_tools.points_at(self._current(self.params[i]), self._ptrs[i])

    # -- repair -----------------------------------------------------------------------
    def rebind(self, i: int) -> bool:
        """If parameter ``i``'s gradient is no longer the alias (replaced, dropped), copy its
        current values into the view (zeros if it has none) and alias it again; returns
        whether anything had to be done."""
        if self.is_bound(i):
            return False
        grad_tools.refill(self.views[i], self._current(self.params[i]))
        with paddle.no_grad():
            self._alias(i)
        return True

    def ensure_bound(self) -> int:
        """:meth:`rebind` every parameter that needs it; returns how many were repaired.
        (Runs before every all_reduce: the common case, nothing to repair, is kept cheap.)"""
        repaired = 0
        for i, (p, ptr) in enumerate(zip(self.params, self._ptrs)):
            if not grad_tools.points_at(self._current(p), ptr):
                repaired += self.rebind(i)
        return repaired

    # -- description --------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return str(self.buffer.dtype).replace("paddle.", "")

    def layout(self) -> list[tuple]:
        """``(bucket index, parameter name, shape, dtype)`` per parameter: what every rank of
        the group must agree on."""
        return [(self.index, p.name, tuple(p.shape), self.dtype) for p in self.params]
