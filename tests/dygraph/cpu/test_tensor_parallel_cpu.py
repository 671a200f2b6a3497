"""Tensor and sequence parallelism on CPU/gloo (paddle_hybrid.dygraph.cpu.tensor_parallel,
.collectives): each replaced op on mp 2 and 4 against the same computation on full
tensors in one process, and fleet layouts (mp 2 and 4; fleet's mp_configs async,
fused-gradient and sync flags; main_grad; group_sharded_parallel beside TP) trained with
Adam against the single-process reference (tp_models.py) on every rank.

Tolerances: the ops that only move data (identity, split, concat, broadcast) and sums
of two ranks' values (all_reduce, reduce_scatter) exact, sums over 4 ranks atol 1e-6
(gloo's order of addition); the parallel softmax cross entropy atol 1e-6 (a sum of
exponentials split in partial sums); training runs rtol = atol = 1e-5 on losses and
atol 1e-5 on parameters against one process and between layouts that reduce gradients
in another order (matmuls on weight slices sum in another order; seen: <= 3.6e-7 after 5
Adam steps); mp_fused_linear_param_grad_add on against off exact (on CPU the same
unfused arithmetic runs).
"""
import os

import numpy as np
import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5


def _train(nprocs, **kw):
    args = []
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    return launch(os.path.join(HERE, "worker_tensor_parallel.py"), nprocs=nprocs, args=args, timeout=300)


def _check(results, steps=5):
    for r in results:
        where = f"rank {r['rank']} (dp, mp, pp) = {r['coords']}"
        assert len(r["losses"]) == steps, where
        np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=TOL, atol=TOL, err_msg=where)
        assert r["params"], where
        for k, got in r["params"].items():
            np.testing.assert_allclose(got, r["ref_params"][k], rtol=0, atol=TOL, err_msg=f"{where} {k}")
    # the ranks of one data-parallel replica report bitwise the same loss
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["coords"][0], []).append(r["losses"])
    for losses in by_dp.values():
        assert all(l == losses[0] for l in losses)


def _op_atol(name, mp):
    """0 where the op only moves data or adds two values (a + b == b + a); 1e-6 for the
    cross entropy and for sums of 4 ranks' values, which gloo adds in another order than
    NumPy's left to right (seen: 2.4e-7)."""
    if "cross_entropy" in name:
        return 1e-6
    sums = name.startswith(("_c_identity", "_mp_allreduce", "reduce_scatter"))
    return 1e-6 if sums and mp > 2 else 0


@pytest.mark.parametrize("mp", [2, 4], ids=["mp2", "mp4"])
def test_replaced_ops_match_single_process(mp):
    results = launch(os.path.join(HERE, "worker_mp_ops.py"), nprocs=mp, timeout=180)
    assert sorted(r["rank"] for r in results) == list(range(mp))
    for r in results:
        assert "_c_identity[skip_c_identity_dynamic]" in r["checks"]
        for name, check in r["checks"].items():
            for key, want in check["want"].items():
                got = np.asarray(check["got"][key])
                atol = _op_atol(name, mp)
                np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=atol,
                                           err_msg=f"rank {r['rank']} {name} {key}")


@pytest.mark.parametrize("sp", [0, 1], ids=["tp2", "tp2_sequence_parallel"])
def test_tp2(sp):
    res = _train(2, mp=2, sp=sp)
    assert all(r["model_class"] == "TensorParallel" for r in res)
    _check(res)


@pytest.mark.parametrize("sp", [0, 1], ids=["tp4", "tp4_sequence_parallel"])
def test_tp4(sp):
    res = _train(4, mp=4, sp=sp)
    assert sorted(r["coords"] for r in res) == [(0, m, 0) for m in range(4)]
    _check(res)


def test_tp2_mp_async_allreduce():
    """mp_configs.mp_async_allreduce (without mp_skip_c_identity): ColumnParallelLinear runs
    Paddle's InnerOverlapLinear, whose forward calls the c_identity kernel itself."""
    res = _train(2, mp=2, mp_configs="mp_async_allreduce")
    assert all(r["mp_configs"] == {"mp_async_allreduce": True} for r in res)
    _check(res)


_SP_ASYNC = "mp_async_allreduce,sp_async_reduce_scatter"
# mp_fused_linear_param_grad_add is read only with mp_async_allreduce; with
# sp_async_reduce_scatter the sequence-parallel column linear runs SPInnerOverlapLinear.
FUSED_GRAD_ADD_CASES = {
    "tp2": {"sp": 0, "mp_configs": "mp_async_allreduce"},
    "sequence_parallel": {"sp": 1, "mp_configs": _SP_ASYNC},
    "sequence_parallel_sync_param_grad_moment": {"sp": 1, "mp_configs": _SP_ASYNC + ",sync_param,sync_grad,sync_moment"},
    "sequence_parallel_main_grad": {"sp": 1, "main_grad": 1, "mp_configs": _SP_ASYNC},
}


@pytest.mark.parametrize("case", list(FUSED_GRAD_ADD_CASES))
def test_fused_linear_param_grad_add_trains_as_unfused(case):
    """mp_configs.mp_fused_linear_param_grad_add: Paddle's overlapped linears need a fused GPU
    kernel in backward. On CPU the same run must give bitwise the numbers of the flag off (the
    same sums, unfused), and both the single-process reference."""
    plain_kw = FUSED_GRAD_ADD_CASES[case]
    fused_kw = dict(plain_kw, mp_configs=plain_kw["mp_configs"] + ",mp_fused_linear_param_grad_add")
    plain = sorted(_train(2, mp=2, **plain_kw), key=lambda r: r["rank"])
    fused = sorted(_train(2, mp=2, **fused_kw), key=lambda r: r["rank"])
    assert all(r["mp_configs"]["mp_fused_linear_param_grad_add"] for r in fused)
    _check(fused)
    for a, b in zip(plain, fused):
        assert a["losses"] == b["losses"], f"rank {a['rank']}"
        for k, want in a["params"].items():
            np.testing.assert_array_equal(b["params"][k], want, err_msg=f"rank {a['rank']} {k}")
    if plain_kw.get("main_grad"):
        assert all(r["main_grads"] > 0 for r in fused)


def test_sequence_parallel_recompute_allgather_of_a_strided_scatter():
    """mp_configs.recompute_allgather: SPInnerOverlapLinear all-gathers its saved input
    again in backward, here the strided scatter of a transposed activation (ScatterMLP)."""
    res = _train(2, mp=2, sp=2, mp_configs=_SP_ASYNC + ",recompute_allgather")
    assert all(r["mp_configs"]["recompute_allgather"] for r in res)
    _check(res)


@pytest.fixture(scope="module")
def tp2_x_dp2_scatter_mlp():
    """TP2 x DP2 with sequence parallel over a strided scatter (tp_models ``ScatterMLP``)."""
    res = _train(4, mp=2, dp=2, sp=2)
    _check(res)
    return {r["coords"]: r for r in res}


@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_tp2_sequence_parallel_x_group_sharded(level, tp2_x_dp2_scatter_mlp):
    """group_sharded_parallel (stage 2, stage 3) on fleet's sharding group beside TP2 with
    sequence parallel: the sequence-parallel linear all-gathers a strided view, which gloo
    refuses unless it is made contiguous. Same data shards as TP2 x DP2: equal to it and to
    one process."""
    res = _train(4, mp=2, sharding=2, sp=2, group_sharded=level)
    want_class = {"os_g": "GroupShardedStage2", "p_g_os": "GroupShardedStage3"}[level]
    assert all(r["model_class"] == want_class for r in res)
    _check(res)
    for r in res:
        dp = tp2_x_dp2_scatter_mlp[r["coords"]]
        where = f"rank {r['rank']} (data shard, mp, pp) = {r['coords']}"
        np.testing.assert_allclose(r["losses"], dp["losses"], rtol=TOL, atol=TOL, err_msg=where)
        for k, got in r["params"].items():
            np.testing.assert_allclose(got, dp["params"][k], rtol=0, atol=TOL, err_msg=f"{where} {k}")


def test_tp2_x_pp2():
    res = _train(4, mp=2, pp=2, acc=4)
    assert sorted(r["coords"] for r in res) == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(r["model_class"] == "PipelineParallel" for r in res)
    _check(res)


def test_dp2_x_tp2_x_pp2_sequence_parallel_batched_p2p():
    """8 processes on 2 cores (~20 s): the full hybrid layout, with sequence parallelism
    and Paddle's default batched p2p."""
    res = _train(8, dp=2, mp=2, pp=2, acc=4, sp=1, batch_p2p=1)
    assert sorted(r["coords"] for r in res) == [(d, m, p) for d in (0, 1) for m in (0, 1) for p in (0, 1)]
    _check(res)


def test_c_split_refuses_a_width_the_degree_does_not_divide():
    """Paddle's CSplitInferMeta divides the last dimension by nranks without a check (leftover
    columns silently dropped); the CPU `_c_split` names the problem instead."""
    import paddle

    from paddle_hybrid.dygraph.cpu import tensor_parallel

    with pytest.raises(ValueError, match="last dimension 5 is not divisible by the model-parallel degree 2"):
        tensor_parallel._own_last_dim_slice(paddle.ones([2, 5]), 0, 2)
    assert tensor_parallel._own_last_dim_slice(paddle.arange(6, dtype="float32").reshape([1, 6]), 1, 2).tolist() == [[3, 4, 5]]
