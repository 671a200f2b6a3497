"""The plugin's CPU kernels over gloo (``paddle_hybrid.gloo.kernels``), reached by Paddle's own
C++ semi-auto reshard functions: Partial -> Shard (reduce_scatter), Shard(i) -> Shard(j)
(all_to_all), a reshard across meshes (p_send / p_recv, and GetDefaultPlace() on the ranks outside
both meshes), on 2 and 3 gloo ranks (4 ranks and 2-D meshes: ``test_reshard_table.py``), each equal to the NumPy value of the global
tensor (exact: small integers in every dtype).  After ``paddle_hybrid.uninstall()`` Paddle's CPU
kernel throws again (the slots are given back); that stock Paddle stops on these paths is shown by
``tests/dygraph/cpu/test_semi_auto_parallelize.py``."""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_gloo_kernels.py")
STOCK_ERROR = "Unimplemented cpu kernel for CReduceScatterOp"


@pytest.mark.parametrize("nranks", [2, 3])  # 4 ranks and the 2-D mesh: test_reshard_table.py
def test_reshards_through_the_gloo_kernels_equal_numpy(nranks):
    results = launch(WORKER, nprocs=nranks, timeout=300)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        for case, value in result["cases"].items():
            np.testing.assert_array_equal(np.asarray(value["got"]), np.asarray(value["expected"]),
                                          err_msg=f"rank {rank}: {case}")
            if "expected_shape" in value:
                assert value["shape"] == value["expected_shape"], (rank, case)
        # Paddle's C++ reached the plugin's kernels (no Python collective on these paths): one
        # reduce_scatter per dtype (an empty tensor needs none), one all_to_all per Shard -> Shard
        assert result["calls"]["ReduceScatterKernel"] >= 7 and result["calls"]["AllToAllKernel"] >= 2, result["calls"]
        if rank == 0:
            assert result["calls"]["PSendKernel"] >= 1
        if rank == nranks - 1:
            assert result["calls"]["PRecvKernel"] >= 1
        assert STOCK_ERROR in result["after_uninstall"], result["after_uninstall"]

