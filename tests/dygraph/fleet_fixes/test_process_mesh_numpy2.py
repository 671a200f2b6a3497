"""``ProcessMesh.get_rank_by_dim_and_process_id`` under NumPy 2 (``fleet_fixes.process_mesh_numpy2``):
every process's coordinate along every dimension of 1-, 2- and 3-D meshes against a loop over the
mesh, by name and by index; -1 outside the mesh, 0 for ``dim=None``.  Paddle's own method raises
"only 0-dimensional arrays can be converted" under NumPy 2 (seen with 2.4.6): asserted, so a
Paddle or NumPy that changes it is seen.

In a fresh process: every ``ProcessMesh`` made registers itself in Paddle's default distributed
context and process group 0, which the static reshard tests of this pytest process read (a 1-D
mesh of 3 made here broke them)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROBE = r'''
import itertools, json
import numpy as np
import paddle.distributed as dist
import paddle_hybrid

MESHES = [([0, 1, 2], ["dp"]), ([[0, 1], [2, 3]], ["dp", "mp"]), ([[3, 1, 5], [0, 2, 4]], ["x", "y"]),
          (np.arange(8).reshape(2, 2, 2).tolist(), ["pp", "dp", "mp"])]
wrong = []
for ids, names in MESHES:
    mesh = dist.ProcessMesh(ids, dim_names=names)
    array = np.asarray(ids)
    for position in itertools.product(*(range(n) for n in array.shape)):
        process = int(array[position])
        for index, name in enumerate(names):
            for dim in (name, index):
                got = mesh.get_rank_by_dim_and_process_id(dim, process)
                if got != position[index]:
                    wrong.append([ids, dim, process, got, position[index]])
        if mesh.get_rank_by_dim_and_process_id(None, process) != 0:
            wrong.append([ids, None, process])
    if mesh.get_rank_by_dim_and_process_id(names[0], 99) != -1:
        wrong.append([ids, "outside"])
try:
    mesh.get_rank_by_dim_and_process_id(1.5, 0)
    bad_dim = None
except ValueError as exc:
    bad_dim = str(exc)
original = next(p["original"] for p in paddle_hybrid.patches()
                if p["name"] == "get_rank_by_dim_and_process_id" and p["component"].endswith("fleet_fixes"))
try:
    paddles_own = ["returned", original(dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]), "mp", 3)]
except TypeError as exc:
    paddles_own = ["TypeError", str(exc)]
print("RESULT" + json.dumps({"wrong": wrong, "bad_dim": bad_dim, "paddles_own": paddles_own,
                              "numpy": np.__version__}))
'''


def test_every_coordinate_and_paddles_own_method_under_numpy_2():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["wrong"] == [], out["wrong"]
    assert out["bad_dim"] == "dim must be a string or an integer.", out
    if int(out["numpy"].split(".")[0]) >= 2:
        assert out["paddles_own"][0] == "TypeError" and "only 0-dimensional arrays" in out["paddles_own"][1], out
    else:
        assert out["paddles_own"] == ["returned", 1], out
