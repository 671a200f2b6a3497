"""(being written) CPU/gloo concern: timers."""
from __future__ import annotations

__all__ = ["apply"]


def apply(patcher) -> None:
    pass
