"""PaddleFormers 1.2's all-to-all expert parallelism with a micro-batch of more than one sequence
(``paddleformers_fixes.moe_alltoall_order``).

``worker_moe_alltoall_order.py`` runs ``ModularMoELayer`` (``moe_token_dispatcher_type="alltoall"``,
4 experts, top-2) on fleet's EP group of 2 over gloo, and feeds each rank's two sequences once as
one micro-batch of 2 and once as two micro-batches of 1.  Stock (``PADDLE_HYBRID_PADDLEFORMERS_FIXES=0``):
the micro-batch of 2 gives other outputs (seen: 6.38 and 3.21 off, on outputs up to 6.5 and 3.9;
8 and 6 of 12 tokens) and other gradients, and equals, to rounding, the mixture with each
(token, expert) pair computed by the expert whose run ``expert * seq_len + token`` sorts it into:
the defect's mechanism, not some other difference.  The micro-batches of 1 equal the dense mixture
in both runs.  Fixed: the micro-batch of 2 equals the two of 1 and the dense mixture.

Tolerance (the fixed run): rtol = atol = 1e-5.  The expert sees both sequences' tokens in one
matmul against one at a time, and the weight gradients sum the tokens in another order (seen:
outputs 1.2e-7 apart, gradients 9.5e-7 on values up to 11).  Seen failing first: the stock run was
made before the fix was written; the fixed test run with ``PADDLE_HYBRID_PADDLEFORMERS_FIXES=0`` (its
``patched`` check left out) fails on rank 0's outputs, 64 of 96 elements, 6.38 apart.
"""
import os
import types
import warnings

import numpy as np
import paddle
import pytest

from paddle_hybrid.testing import launch
from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_moe_alltoall_order.py")
TOL = dict(rtol=1e-5, atol=1e-5)
PATCH = ("paddleformers_fixes", "AllToAllMoECommunication", "forward")


def _run(env):
    return launch(WORKER, nprocs=2, env=env, timeout=240)


def test_stock_micro_batch_of_two_sends_tokens_to_other_experts(paddleformers_version):
    for got in _run({"PADDLE_HYBRID_PADDLEFORMERS_FIXES": "0"}):
        where = f"rank {got['rank']}"
        assert got["patched"] == [], where
        np.testing.assert_allclose(got["out1"], got["dense"], **TOL, err_msg=where)  # one sequence: right
        assert got["pairs_out_of_run"] > 0 and got["pairs_out_of_run_flat"] == 0, where
        assert np.abs(got["out2"] - got["out1"]).max() > 0.1, where
        assert any(np.abs(got["grads2"][k] - got["grads1"][k]).max() > 0.1 for k in got["grads1"]), where
        np.testing.assert_allclose(got["out2"], got["misrouted"], **TOL, err_msg=where)  # the mechanism


def test_fixed_micro_batch_of_two_equals_two_of_one(paddleformers_version):
    for got in _run({}):
        where = f"rank {got['rank']}"
        assert got["patched"] == [PATCH], where
        np.testing.assert_allclose(got["out2"], got["out1"], **TOL, err_msg=where)
        np.testing.assert_allclose(got["out2"], got["dense"], **TOL, err_msg=where)
        assert np.abs(got["out2"] - got["misrouted"]).max() > 0.1, where  # the stock result is gone
        assert got["grads2"].keys() == got["grads1"].keys()
        for name, grad in got["grads2"].items():
            assert np.abs(grad).max() > 0, f"{where} {name}"
            np.testing.assert_allclose(grad, got["grads1"][name], **TOL, err_msg=f"{where} {name}")


# --------------------------------------------------------------------------- the fix alone
def _fake_module():
    """A ``moe_communication`` module whose ``AllToAllMoECommunication.forward`` has PaddleFormers
    1.2's parameters and records the shape it was given."""

    class AllToAllMoECommunication:
        def forward(self, hidden_states, topk_indices, topk_weights, gates_masked, mask, priorities,
                    expert_model_parallel_size, moe_group, experts, moe_rank, num_experts_per_device, num_experts,
                    topk, token_dispatcher):
            return list(hidden_states.shape)

    return types.SimpleNamespace(__name__="fake_moe_communication", AllToAllMoECommunication=AllToAllMoECommunication)


def _call(cls, shape, ep):
    return cls().forward(paddle.zeros(shape), None, None, None, None, None, ep, None, None, 0, 1, 2, 1, None)


def test_patch_flattens_multi_sequence_input_and_is_undone():
    from paddle_hybrid.dygraph.paddleformers_fixes import moe_alltoall_order
    from paddle_hybrid.registry.patching import Patcher

    module = _fake_module()
    cls = module.AllToAllMoECommunication
    stock = cls.forward
    patcher = Patcher("test", "off")
    moe_alltoall_order.apply_to(patcher, module)
    try:
        assert cls.forward is not stock
        assert _call(cls, [2, 3, 4], ep=2) == [6, 4]  # the case the key mixes up
        assert _call(cls, [1, 3, 4], ep=2) == [1, 3, 4]  # one sequence: as it was
        assert _call(cls, [6, 4], ep=2) == [6, 4]
        assert _call(cls, [2, 3, 4], ep=1) == [2, 3, 4]  # EP 1: PaddleFormers returns its input
    finally:
        patcher.revert()
    assert cls.forward is stock


def test_unverified_paddleformers_leaves_it_with_a_warning(monkeypatch):
    from paddle_hybrid.dygraph import paddleformers_fixes
    from paddle_hybrid.registry.patching import Patcher

    module = _fake_module()
    stock = module.AllToAllMoECommunication.forward
    monkeypatch.setattr(paddleformers_fixes, "_paddleformers_version", lambda: "9.9.0")
    patcher = Patcher("test", "off")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        paddleformers_fixes._fix_moe_communication(patcher, module)
    assert any("moe_alltoall_order" in str(w.message) and "this is 9.9.0" in str(w.message) for w in seen), \
        [str(w.message) for w in seen]
    assert not patcher.applied and module.AllToAllMoECommunication.forward is stock
