"""(being written) CPU/gloo concern: virtual_pipeline."""
from __future__ import annotations

__all__ = ["apply"]


def apply(patcher) -> None:
    pass
