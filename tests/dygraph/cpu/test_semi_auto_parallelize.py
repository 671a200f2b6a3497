"""``dist.parallelize`` on CPU over gloo, each layout equal to one process: data parallel at sharding
levels 0-3 (1-3 reduce-scatter gradients: Paddle's CPU kernel throws, the plugin's gloo kernel
runs), tensor parallel, a pipeline across two meshes (send/recv, and eager autograd asking
``GetDefaultPlace()``, a segfault on the stock CPU wheel), and tensor x pipeline on 4 ranks.

The pipeline equals the one-process run bitwise (losses on the last stage, every parameter on
the stage that holds it): the same arithmetic in another place.  Tensor parallel differs by a few
float32 ULPs after three AdamW steps (the row-parallel layer sums two partial products: seen 1.5e-8
absolute in parameters, 1e-7 relative in a loss on MKL's AVX2 path): :data:`REORDERED`.  Levels 1
and 3 stand for the sharding levels (2 runs the same gradient reduce_scatter as 1; level 0 needs no
new kernel).  Data parallel gives each rank
half the batch: two local mean gradients summed against one mean over the whole batch, the same sum
in another float32 order (seen 1e-7 relative, as in ``test_semi_auto_sharding.py``):
:data:`DATA_PARALLEL`.  Without the plugin, levels 1-3 stop on reduce_scatter ("Unimplemented cpu
kernel for CReduceScatterOp") and the pipeline segfaults."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from paddle_hybrid.testing import LaunchError, launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_semi_auto_parallelize.py")
REORDERED = dict(rtol=1e-6, atol=1e-7)  # 10x the largest seen; a wrong gradient is off by > 1e-3
DATA_PARALLEL = dict(rtol=1e-5, atol=1e-6)
TOLERANCE = {"pp": None, "mp": REORDERED, "mppp": REORDERED, **{f"dp{level}": DATA_PARALLEL for level in range(4)}}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("one")
    env = dict(os.environ, PADDLE_HYBRID_RESULT_DIR=str(out_dir), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, WORKER, "--mode", "one"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(os.path.join(out_dir, "rank0.pkl"), "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("mode, nranks, loss_ranks", [
    ("dp1", 2, [0, 1]), ("dp3", 2, [0, 1]), ("mp", 2, [0, 1]),
    ("pp", 2, [1]), ("mppp", 4, [2, 3])])
def test_parallelize_layout_equals_one_process(one_process, mode, nranks, loss_ranks):
    results = launch(WORKER, nprocs=nranks, args=["--mode", mode], timeout=300)
    held = set()
    for result in results:
        if result["rank"] in loss_ranks and mode.startswith("dp"):
            np.testing.assert_allclose(result["losses"], one_process["losses"], **DATA_PARALLEL)
        elif result["rank"] in loss_ranks and TOLERANCE[mode] is None:
            assert result["losses"] == one_process["losses"], (mode, result["rank"])
        elif result["rank"] in loss_ranks:
            np.testing.assert_allclose(result["losses"], one_process["losses"], **TOLERANCE[mode])
        else:  # a stage before the last computes no loss
            assert result["losses"] == [None] * len(one_process["losses"]), (mode, result["rank"])
        for name, value in result["params"].items():
            where = f"{mode} rank {result['rank']} {name}"
            if TOLERANCE[mode] is None:
                np.testing.assert_array_equal(value, one_process["params"][name], err_msg=where)
            else:
                np.testing.assert_allclose(value, one_process["params"][name], err_msg=where, **TOLERANCE[mode])
            held.add(name)
    assert held == set(one_process["params"]), (mode, sorted(held))


@pytest.mark.parametrize("mode", ["dp1", "pp"])
def test_without_the_plugin_paddle_stops(mode):
    with pytest.raises(LaunchError) as stopped:
        launch(WORKER, nprocs=2, args=["--mode", mode], timeout=300, env={"PADDLE_HYBRID_CPU": "off"})
    assert ("Unimplemented cpu kernel for CReduceScatterOp" if mode == "dp1" else "Segmentation fault") in str(stopped.value)
