"""A view of the job's store that puts every key under a prefix: one per gloo group or ring.

Gloo's rendezvous writes the keys "0" .. "n-1" (each rank's address) for every group, and a
TCP store cannot delete keys: groups rendezvousing on one store read each other's addresses.
Paddle prefixes keys in C++ only, and its Python ``Store`` cannot be subclassed from Python, so
the view is C++ (``custom_ops/prefix_store.cc``, built beside the ops as
``paddle_hybrid/_prefix_store.so``) and reaches Paddle as Paddle's own ``Store`` type.

What it replaces: a TCP store per group, hosted by the group's rank 0 on a port of its own,
listening on every interface until the process ended.  With the view the plugin opens no
listening socket; everything lives on the store Paddle's launcher set up for the job.

Waits obey the deadline given here (the job's store would wait for its own timeout); an expired
wait raises ``RuntimeError`` naming the key, ``what`` and the rank that did not write the key.
"""
from __future__ import annotations

__all__ = ["prefix_store"]

_MISSING = (
    "paddle_hybrid: the prefix store extension (_prefix_store.so) {why}. Build it with the ops from the repository "
    "root: `{build}` (or `bash scripts/test.sh`, which sets everything up)."
)


def _extension():
    import importlib

    try:
        return importlib.import_module("paddle_hybrid._prefix_store")
    except ImportError as exc:
        why = "is missing" if "No module named" in str(exc) else f"cannot be loaded ({exc})"
        from ..ops import BUILD_COMMAND

        raise ImportError(_MISSING.format(why=why, build=BUILD_COMMAND)) from exc


def prefix_store(store, prefix: str, timeout: float, what: str, places=()):
    """A ``paddle.base.core.Store`` over ``store`` whose keys are ``prefix + key``.

    ``timeout`` (seconds) bounds every wait on it; ``what`` says whose rendezvous it is and which
    setting bounds it, for the message when a wait expires; ``places[i]`` names the rank at place
    ``i`` of the group (``"rank 3"``): gloo's rendezvous key of a rank ends in its place, so the
    message names the rank whose key never came ("a peer" without ``places``)."""
    return _extension().prefix_store(store, prefix, float(timeout), what, [str(p) for p in places])
