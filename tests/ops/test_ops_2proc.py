"""Both ops in one step on 2 gloo ranks: coalesce, nop, one all_reduce of the
fused buffer; every rank's per-tensor views equal the sum over ranks."""
import os

import numpy as np

from paddle_hybrid.testing import launch


def test_two_ranks_coalesce_nop_allreduce(repo_root):
    results = launch(os.path.join(repo_root, "examples", "ops_2proc.py"), nprocs=2, args=["--tensors", "12"],
                     timeout=180)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        for got, want in zip(r["values"], r["expected"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # both ranks hold bitwise the same reduced values
    for a, b in zip(results[0]["values"], results[1]["values"]):
        np.testing.assert_array_equal(a, b)
