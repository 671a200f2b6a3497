"""When a bucket's gradients are final: from signals, never from counting hook calls.

Counting hooks ("a gradient is final after ``accumulate_steps`` hooks") breaks as soon as a
hook fires more than once per microbatch: re-entrant recompute runs an inner backward for the
recomputed block, and a parameter used inside the block and outside it gets two
contributions, so its bucket would start after the first.  The signals used instead:

* ``is_last_microbatch`` (set by the owner, as Megatron-LM's DDP does): only the gradients
  of the last microbatch before a sync can become final; earlier microbatches just
  accumulate.
* the end of a backward pass: every contribution of that pass is in the buffer, so in the
  last microbatch every parameter that took part is final.
* a hook, for a parameter *known* to get exactly one contribution per pass (observed in an
  earlier complete pass, and never seen with more): its one contribution is in, so it is
  final at once and its bucket may start while backward goes on (the overlap).  A
  parameter never observed, or ever observed with several contributions, waits for the end
  of the pass.
* :meth:`Readiness.finalize_all` (the sync is finishing: every gradient is final,
  including those of parameters that took no part).

Plain Python over flat parameter indices; the protocol (:mod:`.sync`) feeds it.
"""
from __future__ import annotations

__all__ = ["Readiness"]


class Readiness:
    """Which gradients are final in the current sync window.

    Args:
        bucket_of: the bucket index of every parameter (flat order).
        bucket_sizes: the number of parameters of every bucket.
    """

    def __init__(self, bucket_of: list[int], bucket_sizes: list[int]):
        if sorted(set(bucket_of)) != list(range(len(bucket_sizes))):
            raise ValueError("Readiness: bucket_of must name every bucket 0..n-1.")
        self.bucket_of = list(bucket_of)
        self.bucket_sizes = list(bucket_sizes)
        self.is_last_microbatch = True
        n = len(bucket_of)
        self._fired = [0] * n           # contributions in the current backward pass
        self._touched: list[int] = []   # parameters with _fired > 0
        self._once = bytearray(n)       # observed: exactly one contribution per pass
        self._many = bytearray(n)       # observed: more than one (never forgotten)
        self._final = bytearray(n)
        self._missing = list(bucket_sizes)  # per bucket: parameters not yet final

    # -- signals ---------------------------------------------------------------------
    def fire(self, k: int) -> bool:
        """Parameter ``k``'s hook ran (a contribution is on its way).  Returns True if ``k``
        was already final: the caller must check that its bucket has not started."""
        self._fired[k] += 1
        if self._fired[k] == 1:
            self._touched.append(k)
            return False
        self._many[k], self._once[k] = 1, 0
        if self._final[k]:
            self._unfinalize(k)
            return True
        return False

    def accumulated(self, k: int) -> bool:
        """Parameter ``k``'s contribution is in the buffer.  Returns True if this made its
        bucket complete."""
        if (self.is_last_microbatch and self._once[k] and not self._many[k] and self._fired[k] == 1
                and not self._final[k]):
            return self._finalize(k)
        return False

    def backward_done(self) -> bool:
        """A backward pass ended: learn how many contributions each parameter got, and in the
        last microbatch finalize every parameter that took part.  Returns True if some bucket
        became complete."""
        completed = False
        for k in self._touched:
            if self._fired[k] == 1 and not self._many[k]:
                self._once[k] = 1
            if self.is_last_microbatch and not self._final[k]:
                completed |= self._finalize(k)
            self._fired[k] = 0
        self._touched.clear()
        return completed

    def backward_aborted(self) -> None:
        """A backward pass raised: forget its contributions without learning from them."""
        for k in self._touched:
            self._fired[k] = 0
        self._touched.clear()

    def finalize(self, k: int) -> bool:
        """Declare ``k`` final (an owner that knows better); returns True if this made its
        bucket complete."""
        return False if self._final[k] else self._finalize(k)

    def finalize_all(self) -> None:
        for k in range(len(self._final)):
            if not self._final[k]:
                self._finalize(k)

    def new_window(self) -> None:
        """The sync finished: nothing is final in the next window."""
        self._final = bytearray(len(self._final))
        self._missing = list(self.bucket_sizes)

    # -- queries ----------------------------------------------------------------------
    def complete(self, b: int) -> bool:
        return self._missing[b] == 0

    # -- internals -----------------------------------------------------------------
    def _finalize(self, k: int) -> bool:
        self._final[k] = 1
        b = self.bucket_of[k]
        self._missing[b] -= 1
        return self._missing[b] == 0

    def _unfinalize(self, k: int) -> None:
        self._final[k] = 0
        self._missing[self.bucket_of[k]] += 1
