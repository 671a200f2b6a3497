"""PaddleFormers 1.2's DeepEP path under expert parallelism on CPU: DeepSeek-V3 (``DeepseekV3MoEFlexToken``)
through the example and the Trainer, its tokens moved by the plugin's gloo version of DeepEP's dispatch
and combine (``paddleformers_fixes.deepep_standin`` over ``common.deepep_gloo``), with the
sequence-parallel fixes of ``paddleformers_fixes.deepseek_v3_sequence_parallel``; and what builds or
is refused by name under EP (``moe_dispatcher``).

The tiny DeepSeek-V3 of ``examples/paddleformers_trainer.py write-tiny-model --family deepseek_v3``:
hidden 32, 2 layers (layer 0 dense, layer 1 MoE), 4 experts, top-2, a shared expert, DeepSeek-V3's
routing (sigmoid scores, ``noaux_tc`` with one group, normalised weights scaled by 2.5), sequences of
16, 3 steps of accumulation 2, clipping 1.0; auxiliary loss coefficient 0 (PaddleFormers' default).

* EP2: 2 ranks over gloo, the experts' group the tensor-parallel group with sequence parallelism
  (``--tensor_model_parallel_size 2 --sequence_parallel true --use_expert_parallel true
  --expert_model_parallel_size 2``, the only expert-parallel layout the Trainer takes on CPU), against
  one process (``DeepseekV3MoE``, the same weights): the MoE layer is ``DeepseekV3MoEFlexToken`` on
  ``MoEFlexTokenDispatcher`` / ``_DeepepManager`` with the plugin's ``fused_dispatch``, which moved the
  tokens of every forward (6 dispatches and 6 combines a rank); the losses of both ranks equal one
  process's (rtol 1e-5); after training every weight held whole equals one process's (atol 1e-6 + rtol
  1e-5) and is bitwise the same on both ranks, each expert is held by one rank only and equals one
  process's expert of that number, the gate is marked sequence-parallel and moved; the gate's
  correction bias (a parameter under EP, a buffer in one process, never trained) stays 0.
* builds (2 ranks, fleet's EP 2 beside TP 2): DeepSeek-V3, GLM4-MoE without ``use_unified_moe``
  (``Glm4MoeFlexMoE``) and Qwen3-MoE with "deepep" (``ModularMoELayer`` on ``DeepEPMoECommunication``)
  build with sequence parallelism, their gates marked; without sequence parallelism the two Flex
  layers are refused by name (``--sequence_parallel true``); the gloo EP group is served, a group that
  is not gloo is not (the layers are refused there); ``report()`` names the gloo dispatch.

Seen failing first:

* without ``deepep_standin`` (the plugin's refusal as before it): both tests fail, the EP2 run and
  the three builds stop with ``ExpertParallelRefused`` ("dispatches tokens with DeepEP only ..."); with
  that refusal out too, stock's ``ImportError: DeepEP is not supported in your paddlepaddle whl package.``;
* with the gloo dispatch, without ``deepseek_v3_sequence_parallel``: EP2 trains to the end, step-2 loss
  6.1e-6 and step-3 1.7e-5 (relative) off one process, the two ranks' ``model.layers.1.mlp.gate.weight``
  1.9e-4 apart, every weight up to 1.9e-4 off one process (moved 1.0e-4); ``python -m paddle_hybrid.verify
  --layouts sp2ep2`` named the causes: step-1 gradients of the gate 0.97, of ``kv_a_proj_with_mqa`` 0.53,
  of the embedding 0.25 of their largest element off.  Without the rotary-key fix alone: the losses pass
  (7e-6), ``model.embed_tokens.weight`` 1.9e-4 off (the test's first failure); without the gate's mark
  alone: the gate not marked (the first failure of both tests), the ranks' gates 1.9e-4 apart.

Measured (2 cores, two other jobs running): losses equal to 9.4e-8 (relative; steps 2 and 3 to the 8
digits logged), weights 6.0e-8 at most from one process's; the EP2 test 18-21 s (its model written,
one process, 2 ranks), the builds ~6 s.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from paddle_hybrid.testing import launch

import moe_runs
from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture: skip / fail / ok)
from test_trainer import CPU_FLAGS, SCRIPT, _env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker_deepep_families.py")
ARGS = [*CPU_FLAGS, "--max_steps", "3", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
        "--per_device_train_batch_size", "2", "--max_grad_norm", "1.0", "--save_strategy", "no"]
EP2 = ["--tensor_model_parallel_size", "2", "--sequence_parallel", "true", "--use_expert_parallel", "true",
       "--expert_model_parallel_size", "2"]
LOSS_RTOL = 1e-5
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def work(tmp_path_factory, paddleformers_version):
    return str(tmp_path_factory.mktemp("deepep_families"))


def _model(work, family):
    return moe_runs.tiny_model(work, family)


def _train(work, family, name, nprocs, layout=()):
    """The example through the worker (cached per run): see ``moe_runs.train``."""
    return moe_runs.train(WORKER, os.path.join(work, name), _model(work, family), nprocs, [*ARGS, *layout])


_whole = moe_runs.whole


def test_deepseek_v3_expert_parallel_on_gloo_dispatch_equals_one_process(work):
    one = _train(work, "deepseek_v3", "one", 1)
    ep2 = _train(work, "deepseek_v3", "ep2", 2, EP2)
    assert one["meta"][0]["moe_layers"] and all(layer["class"] == "DeepseekV3MoE"
                                                for layer in one["meta"][0]["moe_layers"])
    for rank in (0, 1):
        meta, where = ep2["meta"][rank], f"rank {rank}"
        assert meta["moe_layers"] and all(
            layer["class"] == "DeepseekV3MoEFlexToken" and layer["token_dispatcher"] == "MoEFlexTokenDispatcher"
            and layer["comm_manager"] == "_DeepepManager" for layer in meta["moe_layers"]), (where, meta["moe_layers"])
        assert meta["fused_dispatch"] == "paddle_hybrid.dygraph.paddleformers_fixes.deepep_standin.fused_dispatch"
        assert meta["gloo_calls"] == {"dispatch": 6, "combine": 6}, (where, meta["gloo_calls"])  # 3 steps x 2
        assert "model.layers.1.mlp.gate.weight" in meta["sequence_parallel_marked"], where
        assert sorted(ep2["losses"][rank]) == sorted(one["losses"][0]) == [1, 2, 3], where
        for step, loss in one["losses"][0].items():
            np.testing.assert_allclose(ep2["losses"][rank][step], loss, rtol=LOSS_RTOL, err_msg=f"{where} step {step}")
    reference = one["end"][0]
    experts = {rank: set(ep2["meta"][rank]["experts"]) for rank in (0, 1)}
    expected_experts = {k for k in reference if ".mlp.experts." in k}
    assert experts[0] and experts[1] and not experts[0] & experts[1], experts
    assert experts[0] | experts[1] == expected_experts, sorted(expected_experts ^ (experts[0] | experts[1]))
    for name, want in reference.items():
        if name in expected_experts:
            holder = 0 if name in experts[0] else 1
            np.testing.assert_allclose(ep2["end"][holder][name], want, **PARAM_TOL, err_msg=f"{name} (rank {holder})")
            continue
        got0, got1 = (_whole(ep2["end"][rank], name, want) for rank in (0, 1))
        np.testing.assert_array_equal(got0, got1, err_msg=f"{name}: the two ranks' copies")
        np.testing.assert_allclose(got0, want, **PARAM_TOL, err_msg=name)
    extra = set(ep2["end"][0]) - set(reference) - {k for k in ep2["end"][0] if k.endswith("::by_part")}
    assert extra == {"model.layers.1.mlp.gate.e_score_correction_bias"}, extra  # a buffer in one process
    assert not ep2["end"][0]["model.layers.1.mlp.gate.e_score_correction_bias"].any()
    moved = {k: np.abs(reference[k] - one["start"][0][k]).max() for k in ("model.layers.1.mlp.gate.weight",
                                                                          "model.layers.1.mlp.experts.3.up_proj.weight")}
    assert all(v > 10 * PARAM_TOL["atol"] for v in moved.values()), moved


def test_deepep_layers_build_on_gloo_and_refusals(paddleformers_version):
    results = launch(WORKER, nprocs=2, args=["builds"], env={"OMP_NUM_THREADS": "1"}, timeout=240)
    built = {"deepseek_v3": ("DeepseekV3MoEFlexToken", None), "glm4_moe flex": ("Glm4MoeFlexMoE", None),
             "qwen3_moe deepep": ("ModularMoELayer", "DeepEPMoECommunication")}
    for result in results:
        cases, where = result["cases"], f"rank {result['rank']}"
        assert result["served"] == {"gloo": True, "not gloo": False, "deep_ep_available": False}, result["served"]
        assert "fused_dispatch / fused_combine" in result["report"] and "deepep_standin" in result["report"]
        for case, (cls, communication) in built.items():
            error, held = cases[case]
            assert error is None, (where, case, error)
            assert held["moe_layers"] and all(
                layer["class"] == cls and layer["communication"] == communication
                and layer["comm_manager"] == "_DeepepManager" for layer in held["moe_layers"]), (where, case, held)
            assert all(f"{layer['name']}.gate.weight" in held["sequence_parallel_marked"]
                       for layer in held["moe_layers"]), (where, case, held["sequence_parallel_marked"])
        for case, family in (("deepseek_v3 without sequence parallel", "DeepSeek-V3 (DeepseekV3MoEFlexToken)"),
                             ("glm4_moe flex without sequence parallel", "GLM4-MoE (Glm4MoeFlexMoE)")):
            error, _ = cases[case]
            assert error is not None and error[0] == "ExpertParallelRefused", (where, case, error)
            assert family in error[1] and "--sequence_parallel true" in error[1], (where, case, error[1])


def test_deepseek_v3_own_moe_block_under_sequence_parallel_equals_one_process(work):
    """Without expert parallelism DeepSeek-V3's own MoE block (``DeepseekV3MoE``: routed experts whole on
    every TP rank, fed that rank's part of the sequence) at TP2 with sequence parallelism, through
    ``python -m paddle_hybrid.verify --layouts sp2``: equal to one process once its experts' and router's
    weights are marked sequence-parallel (``deepseek_v3_sequence_parallel``).  Seen failing first: step-1
    gradients 1.1 of their tensors' largest element off, parameters 140 times their tolerance at the end."""
    out = os.path.join(work, "verify-sp2.json")
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify", "--layouts", "sp2", "--json", out, SCRIPT,
                           "--model_name_or_path", _model(work, "deepseek_v3"), "--output_dir", "unused", *CPU_FLAGS,
                           "--max_steps", "2", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size",
                           "2", "--max_grad_norm", "1.0", "--save_strategy", "no"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        verdict = json.load(f)["layouts"]["sp2"]
    assert verdict["equal"] and not verdict["findings"], verdict
