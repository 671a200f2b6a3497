"""Environment variables as they were before Paddle was first imported in this process.

``import paddle`` sets ``OMP_NUM_THREADS=1`` when it is unset (``paddle/base/__init__.py``,
``__bootstrap__``), so afterwards "did the user set it?" has no answer.  ``paddle_hybrid``
imports this module before anything that imports Paddle; ``python -m paddle_hybrid.launch``
reads it to keep a user's value and choose its own otherwise.
"""
import os
import sys

__all__ = ["PADDLE_WAS_IMPORTED", "OMP_NUM_THREADS"]

PADDLE_WAS_IMPORTED = "paddle" in sys.modules
"""True when Paddle was imported before ``paddle_hybrid``: the values below are then Paddle's."""

OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")
