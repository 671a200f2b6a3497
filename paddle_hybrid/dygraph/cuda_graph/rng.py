"""The random state a warmup run must leave as it found it: Paddle's
generator and fleet's model-parallel RNG tracker (dropout inside
tensor-parallel layers draws from the tracker's states).

Warmup runs are thrown away; if they consumed random numbers, the captured
graph and every later eager op would draw different ones than a run without
the wrapper.  A failure to read or put back either state is raised, naming
the state: carrying on would silently change dropout masks.
"""
from __future__ import annotations

import paddle

from .errors import CudaGraphError

__all__ = ["RngState", "fleet_rng_tracker"]


def fleet_rng_tracker():
    """Fleet's model-parallel RNG tracker, or None in a Paddle built without
    ``paddle.distributed.fleet`` (the only case in which there is none)."""
    try:
        from paddle.distributed.fleet.meta_parallel.parallel_layers.random import get_rng_state_tracker
    except ImportError:
        return None
    return get_rng_state_tracker()


class RngState:
    """A snapshot of both random states, taken at construction; :meth:`restore` puts it back."""

    def __init__(self):
        self._paddle = paddle.get_rng_state()
        self._tracker = fleet_rng_tracker()
        self._tracker_states = None
        if self._tracker is not None:
            try:
                self._tracker_states = self._tracker.get_states_tracker()
            except Exception as exc:
                raise CudaGraphError(
                    "could not read the states of fleet's model-parallel RNG tracker before "
                    f"warmup ({exc!r}); without them warmup would change later dropout masks."
                ) from exc

    def restore(self) -> None:
        # Paddle's generator first: it must be put back even if the tracker fails.
        paddle.set_rng_state(self._paddle)
        if self._tracker is None:
            return
        try:
            self._tracker.set_states_tracker(self._tracker_states)
        except Exception as exc:
            raise CudaGraphError(
                "could not put back the states of fleet's model-parallel RNG tracker after "
                f"warmup ({exc!r}); dropout masks from here on would differ from a run without "
                "the graphed layer."
            ) from exc
