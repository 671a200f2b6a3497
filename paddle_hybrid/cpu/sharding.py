"""(being written) CPU/gloo concern: sharding."""
from __future__ import annotations

__all__ = ["apply"]


def apply(patcher) -> None:
    pass
