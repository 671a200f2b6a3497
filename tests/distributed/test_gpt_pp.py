"""A short run of examples/gpt_pp.py on 2 CPU processes (PP=2): it trains,
both pipeline stages report the same losses, the loss falls, the JSON log is
written."""
import json
import os

import numpy as np

from paddle_hybrid.testing import launch

SHORT = ["--steps", "8", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32",
         "--micro-batch-size", "4", "--accumulate-steps", "2", "--lr", "1e-2", "--corpus-chars", "20000"]


def test_gpt_pp_short_run(repo_root, tmp_path):
    out_dir = tmp_path / "out"
    results = launch(os.path.join(repo_root, "examples", "gpt_pp.py"), nprocs=2,
                     args=SHORT + ["--out-dir", str(out_dir)], timeout=300)
    l0, l1 = np.array(results[0]["losses"]), np.array(results[1]["losses"])
    assert len(l0) == 8 and np.all(np.isfinite(l0))
    np.testing.assert_array_equal(l0, l1)  # the last stage's loss, broadcast to every stage
    assert l0[-3:].mean() < l0[:3].mean() - 0.1, l0
    with open(out_dir / "pp2_vp1_dp1.json") as f:
        log = json.load(f)
    assert log["losses"] == results[0]["losses"]
    assert log["world_size"] == 2 and log["args"]["pp"] == 2
