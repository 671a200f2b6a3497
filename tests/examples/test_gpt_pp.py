"""A short run of examples/gpt_pp.py on 2 CPU processes (PP=2): it trains,
both pipeline stages report the same losses, the loss falls, the JSON log is
written."""
import json
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

# CI's 3.2.2 lane only (tests/conftest.py): the same layouts are checked in both lanes by tests/verify/test_verify_layouts.py
pytestmark = pytest.mark.one_lane

SHORT = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32",
         "--micro-batch-size", "4", "--accumulate-steps", "2", "--lr", "1e-2", "--corpus-chars", "20000"]


def test_gpt_pp_short_run(repo_root, tmp_path):
    out_dir = tmp_path / "out"
    results = launch(os.path.join(repo_root, "examples", "gpt_pp.py"), nprocs=2,
                     args=SHORT + ["--steps", "8", "--out-dir", str(out_dir)], timeout=300)
    l0, l1 = np.array(results[0]["losses"]), np.array(results[1]["losses"])
    assert len(l0) == 8 and np.all(np.isfinite(l0))
    np.testing.assert_array_equal(l0, l1)  # the last stage's loss, broadcast to every stage
    assert l0[-3:].mean() < l0[:3].mean() - 0.1, l0
    with open(out_dir / "pp2_vp1_dp1.json") as f:
        log = json.load(f)
    assert log["losses"] == results[0]["losses"]
    assert log["world_size"] == 2 and log["args"]["pp"] == 2


def _losses(repo_root, tmp_path, nprocs, *flags, env=None):
    out = launch(os.path.join(repo_root, "examples", "gpt_pp.py"), nprocs=nprocs,
                 args=SHORT + ["--steps", "4", "--out-dir", str(tmp_path / "out")] + list(flags), timeout=300, env=env)
    losses = [r["losses"] for r in out]
    assert all(l == losses[0] for l in losses), "every rank of one replica reports the same loss"
    return np.array(losses[0])


def test_layouts_train_like_one_process(repo_root, tmp_path):
    """Tensor, sequence and pipeline parallel, recompute, on 4 ranks: the example's weights are
    drawn per full matrix and sliced, so without dropout every layout gives the single-process
    losses (AdamW, global-norm clipping; rtol 1e-5 for summation order, seen <= 1e-6).  PP2 and
    TP2 + sequence parallel alone, losses and parameters: ``tests/verify/test_verify.py``."""
    one = _losses(repo_root, tmp_path, 1, "--pp", "1")
    for nprocs, flags in ((4, ["--pp", "2", "--mp", "2", "--sequence-parallel", "--recompute", "--batch-p2p"]),):
        np.testing.assert_allclose(_losses(repo_root, tmp_path, nprocs, *flags), one, rtol=1e-5, err_msg=str(flags))


def test_data_parallel_layouts_train_like_one_process(repo_root, tmp_path):
    """Data parallel and sharding replicas each train on their slice of the global batch;
    the example reports the loss of the whole batch, which must equal one process running
    all of it (2 replicas x 2 microbatches vs 4 microbatches; rtol 1e-5).  Group-sharded stages 2
    and 3, losses, gradients and parameters: ``tests/verify/test_verify_layouts.py``."""
    one = _losses(repo_root, tmp_path, 1, "--pp", "1", "--accumulate-steps", "4")
    for nprocs, flags in ((2, ["--pp", "1", "--dp", "2"]),
                          (2, ["--pp", "1", "--sharding", "2"]),
                          (4, ["--pp", "2", "--sharding", "2"]),
                          (4, ["--pp", "2", "--dp", "2", "--fuse-allreduce"])):
        got = _losses(repo_root, tmp_path, nprocs, *flags, "--accumulate-steps", "2")
        np.testing.assert_allclose(got, one, rtol=1e-5, err_msg=str(flags))


def test_recompute_with_dropout_is_exact(repo_root, tmp_path):
    """PP=2 x TP=2 with dropout: recompute redraws the same masks (replicated and
    model-parallel RNG), so the losses equal the run without recompute bitwise."""
    flags = ["--pp", "2", "--mp", "2", "--dropout", "0.1"]
    plain = _losses(repo_root, tmp_path, 4, *flags)
    np.testing.assert_array_equal(_losses(repo_root, tmp_path, 4, *flags, "--recompute"), plain)


def test_selective_recompute_is_exact(repo_root, tmp_path):
    """``--recompute selective`` (the attention core, softmax(QK^T)V, through fleet's recompute_hybrid)
    at TP=2 with dropout: the recompute redraws the attention-probability masks (model-parallel RNG),
    so the losses equal the run without recompute bitwise, and so does every parameter of every rank
    after training.  The core ran twice per block and microbatch (forward, backward: 2 x 2 blocks x 2
    microbatches x 3 steps), and never without it."""
    flags = SHORT + ["--out-dir", str(tmp_path / "out"), "--pp", "1", "--mp", "2", "--dropout", "0.1", "--steps", "3"]
    worker = os.path.join(repo_root, "tests", "examples", "gpt_pp_recompute_counter.py")
    plain = launch(worker, nprocs=2, args=flags, timeout=300)
    selective = launch(worker, nprocs=2, args=flags + ["--recompute", "selective"], timeout=300)
    assert [r["recomputed"] for r in plain] == [0, 0]
    assert [r["recomputed"] for r in selective] == [24, 24]
    for p, s in zip(plain, selective):
        np.testing.assert_array_equal(np.array(s["losses"]), np.array(p["losses"]))
        assert p["weights"] and s["weights"] == p["weights"]


def test_vocab_and_ffn_train_like_one_process(repo_root, tmp_path):
    """``--vocab 1000 --ffn 96`` (synthetic tokens, a 96-wide MLP) at TP=2 gives the single-process
    losses (rtol 1e-5, as the layouts above)."""
    flags = ["--vocab", "1000", "--ffn", "96", "--steps", "3"]
    out = launch(os.path.join(repo_root, "examples", "gpt_pp.py"), nprocs=1, timeout=300,
                 args=SHORT + ["--out-dir", str(tmp_path / "out"), "--pp", "1"] + flags)
    assert (out[0]["summary"]["vocab_size"], out[0]["summary"]["ffn"]) == (1000, 96)
    one = np.array(out[0]["losses"])
    assert abs(one[0] - np.log(1000)) < 0.5, one  # the loss of a 1000-way guess: the vocabulary is 1000
    np.testing.assert_allclose(_losses(repo_root, tmp_path, 2, "--pp", "1", "--mp", "2", *flags), one, rtol=1e-5)
