"""``ProcessMesh.get_rank_by_dim_and_process_id`` under NumPy 2 (``fleet_fixes.process_mesh_numpy2``):
every process's coordinate along every dimension of 1-, 2- and 3-D meshes against a loop over the
mesh, by name and by index; -1 outside the mesh, 0 for ``dim=None``.  Paddle's own method raises
"only 0-dimensional arrays can be converted" under NumPy 2 (seen with 2.4.6): asserted, so a
Paddle or NumPy that changes it is seen."""
import itertools

import numpy as np
import paddle.distributed as dist
import pytest

import paddle_hybrid

MESHES = [([0, 1, 2], ["dp"]), ([[0, 1], [2, 3]], ["dp", "mp"]), ([[3, 1, 5], [0, 2, 4]], ["x", "y"]),
          (np.arange(8).reshape(2, 2, 2).tolist(), ["pp", "dp", "mp"])]


def _paddles_own():
    for p in paddle_hybrid.patches():
        if p["name"] == "get_rank_by_dim_and_process_id" and p["component"].endswith("fleet_fixes"):
            return p["original"]
    raise AssertionError("fleet_fixes did not replace ProcessMesh.get_rank_by_dim_and_process_id")


@pytest.mark.parametrize("ids, names", MESHES)
def test_every_coordinate_by_name_and_by_index(ids, names):
    mesh = dist.ProcessMesh(ids, dim_names=names)
    array = np.asarray(ids)
    for position in itertools.product(*(range(n) for n in array.shape)):
        process = int(array[position])
        for index, name in enumerate(names):
            assert mesh.get_rank_by_dim_and_process_id(name, process) == position[index], (ids, name, process)
            assert mesh.get_rank_by_dim_and_process_id(index, process) == position[index], (ids, index, process)
        assert mesh.get_rank_by_dim_and_process_id(None, process) == 0
    assert mesh.get_rank_by_dim_and_process_id(names[0], 99) == -1
    with pytest.raises(ValueError, match="dim must be a string or an integer"):
        mesh.get_rank_by_dim_and_process_id(1.5, int(array.flat[0]))


def test_paddles_own_method_stops_under_numpy_2():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    original = _paddles_own()
    if int(np.__version__.split(".")[0]) >= 2:
        with pytest.raises(TypeError, match="only 0-dimensional arrays"):
            original(mesh, "mp", 3)
    else:
        assert original(mesh, "mp", 3) == 1
