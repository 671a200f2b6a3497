"""The balanced routing rule: token ``t`` of a batch to experts ``(t * k + i) mod E`` for ``i < k``."""
from __future__ import annotations

import numpy as np

__all__ = ["balanced_indices"]


def balanced_indices(tokens: int, top_k: int, experts: int) -> np.ndarray:
    """``[tokens, top_k]`` int64 expert indices: token ``t`` to ``(t * top_k + i) mod experts``;
    every expert gets ``tokens * top_k // experts`` tokens or one more, and a token's experts are
    distinct."""
    if experts < 1 or not 0 < top_k <= experts:
        raise ValueError(f"paddle_hybrid.dygraph.balanced_routing: a gate asks for top_k={top_k} of {experts} "
                         "experts; top_k must be between 1 and the number of experts.")
    return (np.arange(tokens * top_k, dtype=np.int64) % experts).reshape(tokens, top_k)
