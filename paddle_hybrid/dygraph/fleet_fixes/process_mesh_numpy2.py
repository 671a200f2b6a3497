"""``ProcessMesh.get_rank_by_dim_and_process_id`` answers under NumPy 2.

Paddle 3.2.2 and 3.3.1 return ``int(np.where(self._mesh == process_id)[dim_index])``: the
coordinates of the process along that dimension, a 1-element 1-D array.  NumPy 2 no longer
converts an array of one or more dimensions to a Python scalar ("TypeError: only 0-dimensional
arrays can be converted to Python scalars", seen with NumPy 2.4), so every caller stops on every
device: ``dist.shard_dataloader(..., shard_dims=...)`` (``paddle/io/reader.py``, ``api.py``),
auto-parallel sharding with a pipeline dimension, ring attention.

Patch: the same lookup, taking the one coordinate, with Paddle's own answers kept for a process
outside the mesh (-1) and for ``dim=None`` (0).
"""
from __future__ import annotations

import functools

__all__ = ["apply", "rank_by_dim_and_process_id"]


def rank_by_dim_and_process_id(mesh, dim, process_id) -> int:
    """The coordinate of ``process_id`` along mesh dimension ``dim`` (a name or an index)."""
    import numpy as np

    if process_id not in mesh._process_ids:
        return -1
    if dim is None:
        return 0
    if isinstance(dim, int):
        dim_name = mesh._dim_names[dim]
    elif isinstance(dim, str):
        dim_name = dim
    else:
        raise ValueError("dim must be a string or an integer.")
    coordinates = np.argwhere(np.asarray(mesh._mesh) == process_id)[0]
    return int(coordinates[mesh._dim_names.index(dim_name)])


def _make(original):
    @functools.wraps(original)
    def get_rank_by_dim_and_process_id(self, dim, process_id):
        return rank_by_dim_and_process_id(self, dim, process_id)

    return get_rank_by_dim_and_process_id


def apply(config, patcher) -> None:
    from paddle.distributed.auto_parallel.process_mesh import ProcessMesh

    original = patcher.require(ProcessMesh, "get_rank_by_dim_and_process_id",
                               "paddle.distributed.auto_parallel.process_mesh.ProcessMesh")
    patcher.check_params(original, ["self", "dim", "process_id"], "ProcessMesh.get_rank_by_dim_and_process_id")
    patcher.set(ProcessMesh, "get_rank_by_dim_and_process_id", _make(original))
