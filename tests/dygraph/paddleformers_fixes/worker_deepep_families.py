"""Worker of ``test_deepep_families.py``: ``worker_moe_families.py train`` (the example trained as it
is, every parameter dumped at the start and the end of training), with two differences for the
Flex token dispatcher's layers:

* a parameter PaddleFormers marks ``is_distributed`` without a split axis (DeepSeek-V3's gate
  ``e_score_correction_bias`` under expert parallelism: held whole by every rank, never trained) is
  dumped as this rank holds it;
* ``meta.rank<N>.json`` also says how many times each rank's tokens went through the gloo
  dispatch and combine (``paddle_hybrid.common.deepep_gloo``), what
  ``token_dispatcher.fused_dispatch`` is, and each MoE layer's token dispatcher.

    worker_deepep_families.py train EXAMPLE [the example's arguments]

    worker_deepep_families.py builds        (launched on 2 ranks: fleet's EP group of 2 beside TP 2)
        Builds the layers that dispatch with DeepEP under expert parallelism (DeepSeek-V3, GLM4-MoE
        without ``use_unified_moe``, Qwen3-MoE with "deepep"), with and without sequence parallelism,
        and saves per case what was raised (None: built) and what the built model holds; also whether
        the plugin says the gloo EP group, and a group that is not gloo, are served.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import worker_moe_families as base  # noqa: E402

CALLS = {"dispatch": 0, "combine": 0}


def _count_calls():
    from paddle_hybrid.common import deepep_gloo

    for name in ("dispatch", "combine"):
        original = getattr(deepep_gloo, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            CALLS[_name] += 1
            return _original(*args, **kwargs)

        setattr(deepep_gloo, name, counted)


def _dump(label, model, output_dir):
    import numpy as np

    inner, arrays, experts, marked = base.whole_parameters(model)
    rank = base._rank()
    np.savez(os.path.join(output_dir, f"{label}.rank{rank}.npz"), **arrays)
    if label == "end":
        dispatcher = sys.modules.get("paddleformers.transformers.token_dispatcher")
        fused = getattr(dispatcher, "fused_dispatch", None)
        layers = base._moe_layers(inner)
        for layer in layers:
            sub = dict(inner.named_sublayers())[layer["name"]]
            manager = getattr(getattr(sub, "token_dispatcher", None), "_comm_manager", None)
            layer["comm_manager"] = type(manager).__name__
        with open(os.path.join(output_dir, f"meta.rank{rank}.json"), "w") as f:
            json.dump({"class": type(inner).__name__, "experts": experts, "moe_layers": layers,
                       "sequence_parallel_marked": marked, "gloo_calls": CALLS,
                       "fused_dispatch": None if fused is None else f"{fused.__module__}.{fused.__name__}"}, f)


def builds():
    import importlib
    import types

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils.sequence_parallel_utils import is_sequence_parallel_parameter

    import paddle_hybrid
    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    world = dist.get_world_size()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1, "sharding_degree": 1,
                               "ep_degree": world,
                               "order": ["pp", "sharding", "dp", "sep", "cp", "mp", "ep", "moe_sharding"]}
    fleet.init(is_collective=True, strategy=strategy)

    def model(family, config_name, class_name, sequence_parallel=True, meta=None, **settings):
        def build():
            classes = importlib.import_module(f"paddleformers.transformers.{family}.modeling")
            config = getattr(classes, config_name)(**{**base.TINY, **settings})
            for key, value in {"tensor_model_parallel_size": world, "tensor_parallel_rank": dist.get_rank(),
                               "sequence_parallel": sequence_parallel, **(meta or {})}.items():
                setattr(config, key, value)
            paddle.seed(0)
            built = getattr(classes, class_name)(config)
            layers = base._moe_layers(built)
            for layer in layers:
                sub = dict(built.named_sublayers())[layer["name"]]
                manager = getattr(getattr(sub, "token_dispatcher", None), "_comm_manager", None)
                layer["comm_manager"] = type(manager).__name__
            return {"moe_layers": layers,
                    "sequence_parallel_marked": [n for n, p in built.named_parameters()
                                                 if is_sequence_parallel_parameter(p)]}

        return base._attempt(build)

    deepseek = dict(first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                    v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_shared_experts=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "factor": 1.0})
    glm4 = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                first_k_dense_replace=1, n_group=1, topk_group=1)
    qwen3 = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                 mlp_only_layers=[])
    cases = {
        "deepseek_v3": model("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", **deepseek),
        "glm4_moe flex": model("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated", **glm4),
        "qwen3_moe deepep": model("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated", **qwen3),
        "deepseek_v3 without sequence parallel": model("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                                                       sequence_parallel=False, **deepseek),
        "glm4_moe flex without sequence parallel": model("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated",
                                                         sequence_parallel=False, **glm4),
    }
    from paddle_hybrid.dygraph.paddleformers_fixes import moe_dispatcher

    group = fleet.get_hybrid_communicate_group().get_expert_parallel_group()
    served = {"gloo": moe_dispatcher.flex_dispatch_serves(group),
              "not gloo": moe_dispatcher.flex_dispatch_serves(types.SimpleNamespace(process_group=object())),
              "deep_ep_available": moe_dispatcher.deep_ep_available()}
    save_result({"rank": dist.get_rank(), "cases": cases, "served": served, "report": paddle_hybrid.report()})


if __name__ == "__main__":
    if sys.argv[1] == "builds":
        builds()
        sys.exit(0)
    if sys.argv[1] != "train":
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
    import paddle_hybrid  # noqa: F401  (the launcher imported it already; one process needs it here)

    _count_calls()
    base._dump = _dump
    base.train(sys.argv[2], sys.argv[3:])
