"""(being written) CPU/gloo concern: tensor_parallel."""
from __future__ import annotations

__all__ = ["apply"]


def apply(patcher) -> None:
    pass
