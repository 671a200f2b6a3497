"""examples/moe_ep.py: the MoE language model trained with EP=2 and EP=4 (naive top-2 gate)
reports the losses of one process holding every expert, step by step (AdamW; rtol 1e-5 for the
order of float32 sums, seen equal to 5 decimals), and its loss falls."""
import json
import os
import subprocess
import sys

import numpy as np


def _losses(repo_root, tmp_path, nprocs):
    """The example as a user runs it: ``python -m paddle_hybrid.launch`` (the JSON of rank 0)."""
    out = tmp_path / f"ep{nprocs}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo_root)
    cmd = [sys.executable, "-m", "paddle_hybrid.launch", "--nproc_per_node", str(nprocs), "--log_dir",
           str(tmp_path / f"log{nprocs}"), os.path.join(repo_root, "examples", "moe_ep.py"), "--steps", "6",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    logs = "".join(open(tmp_path / f"log{nprocs}" / f"workerlog.{r}").read()[-2000:] for r in range(nprocs))
    assert proc.returncode == 0, f"EP={nprocs} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{logs}"
    with open(out) as f:
        return np.array(json.load(f)["losses"])


def test_expert_parallel_trains_like_one_process(repo_root, tmp_path):
    one = _losses(repo_root, tmp_path, 1)
    assert one[-2:].mean() < one[:2].mean() - 0.3, one
    for nprocs in (2, 4):
        np.testing.assert_allclose(_losses(repo_root, tmp_path, nprocs), one, rtol=1e-5, err_msg=f"EP={nprocs}")
