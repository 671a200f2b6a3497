"""(being written) CPU/gloo concern: recompute."""
from __future__ import annotations

__all__ = ["apply"]


def apply(patcher) -> None:
    pass
