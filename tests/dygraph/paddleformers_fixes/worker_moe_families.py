"""Worker of ``test_moe_families.py``: PaddleFormers 1.2's Qwen3-MoE / GLM4-MoE / Qwen2-MoE / DeepSeek-V3
through the plugin's stand-ins of paddlefleet (``paddleformers_fixes.paddlefleet_standins``), in a
process of its own so no stand-in module reaches the test process.

    worker_moe_families.py train EXAMPLE [the example's arguments]
        Wraps examples/paddleformers_trainer.py: trains as the example does, and writes into its
        ``--output_dir``, per rank, ``start.rank<N>.npz`` (when training begins) and ``end.rank<N>.npz``
        (after ``train()``): every parameter under its one-process name, a tensor-parallel slice joined
        into its whole value (``paddle_hybrid.common.logical_params.whole``; a fused projection also as
        ``<name>::by_part``), an expert of expert parallelism as this rank holds it (PaddleFormers numbers
        the experts of the whole model on every rank); and ``meta.rank<N>.json``: the model class, the
        experts this rank holds, each MoE layer's class, communication and token dispatcher, the
        parameters marked sequence-parallel.

    worker_moe_families.py refusals          (launched on 2 ranks: fleet's EP group of 2 beside TP 2)
        Builds each family's own model under expert parallelism and saves, per case, the class of
        what it raised and its message (None: it built), with what the built one holds.

``PADDLE_HYBRID_PADDLEFORMERS_FIXES=0`` in the environment gives stock PaddleFormers.
"""
import json
import os
import runpy
import sys

import numpy as np

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=64, dtype="float32", pad_token_id=None,
            fuse_rms_norm=False, use_fused_linear_cross_entropy=False, apply_rope_fusion=False, fuse_swiglu=False,
            use_fused_head_and_loss_fn=False, _attn_implementation="sdpa", seq_length=16, max_sequence_length=16)


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def _moe_layers(model):
    out = []
    for name, layer in model.named_sublayers():
        if hasattr(layer, "experts") and hasattr(layer, "gate"):
            communication = getattr(layer, "communication", None)
            out.append({"name": name, "class": type(layer).__name__,
                        "communication": type(communication).__name__ if communication is not None else None,
                        "token_dispatcher": type(getattr(layer, "token_dispatcher", None)).__name__})
    return out


def whole_parameters(model):
    """``(inner model, {name: whole value}, expert names, sequence-parallel-marked names)``: every
    parameter's whole value (a collective over the tensor-parallel group); an expert, and a weight marked
    distributed without a split axis (DeepSeek-V3's gate correction bias), as this rank holds it."""
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils.sequence_parallel_utils import is_sequence_parallel_parameter

    from paddle_hybrid.common.logical_params import named_parameters, unwrap, whole

    inner = unwrap(model)
    try:
        group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    except Exception:  # noqa: BLE001  (one process: no hybrid group)
        group = None
    arrays, experts, marked = {}, [], []
    for name, param in named_parameters(inner):
        if is_sequence_parallel_parameter(param):
            marked.append(name)
        if getattr(param, "expert", False) or getattr(param, "no_sync", False):
            arrays[name] = param.numpy()
            experts.append(name)
            continue
        if getattr(param, "is_distributed", False) and getattr(param, "split_axis", None) is None:
            arrays[name] = param.numpy()  # held whole
            continue
        for key, value in whole(param, group, name, inner.config).items():
            arrays[name + (f"::{key}" if key else "")] = value
    return inner, arrays, experts, marked


def _dump(label, model, output_dir):
    """Every parameter's whole value, and at the end what the model holds (meta)."""
    inner, arrays, experts, marked = whole_parameters(model)
    rank = _rank()
    np.savez(os.path.join(output_dir, f"{label}.rank{rank}.npz"), **arrays)
    if label == "end":
        with open(os.path.join(output_dir, f"meta.rank{rank}.json"), "w") as f:
            json.dump({"class": type(inner).__name__, "experts": experts, "moe_layers": _moe_layers(inner),
                       "sequence_parallel_marked": marked}, f)


def train(example_path, argv):
    example = runpy.run_path(example_path)  # the example's functions; its __main__ block does not run
    record_progress = example["record_progress"]
    output_dir = argv[argv.index("--output_dir") + 1]

    def with_start(out):
        callback = record_progress(out)
        inner = callback.on_train_begin

        def on_train_begin(args, state, control, **kwargs):
            _dump("start", kwargs["model"], output_dir)
            return inner(args, state, control, **kwargs)

        callback.on_train_begin = on_train_begin
        return callback

    example["main"].__globals__["record_progress"] = with_start  # main() looks it up there (run_path gave a copy)
    trainer = example["main"](argv)
    _dump("end", trainer.model, output_dir)


def _attempt(build):
    try:
        return None, build()
    except Exception as exc:  # noqa: BLE001  (what is raised is the result)
        return [type(exc).__name__, str(exc)], None


def refusals():
    import importlib

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    world = dist.get_world_size()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": world, "pp_degree": 1, "sharding_degree": 1,
                               "ep_degree": world,
                               "order": ["pp", "sharding", "dp", "sep", "cp", "mp", "ep", "moe_sharding"]}
    fleet.init(is_collective=True, strategy=strategy)
    parallel = dict(tensor_model_parallel_size=world, tensor_parallel_rank=dist.get_rank(), sequence_parallel=True)

    def model(family, config_name, class_name, meta=None, **settings):
        def build():
            classes = importlib.import_module(f"paddleformers.transformers.{family}.modeling")
            config = getattr(classes, config_name)(**{**TINY, **settings})
            for key, value in {**parallel, **(meta or {})}.items():  # as a script sets them: after the config
                setattr(config, key, value)
            paddle.seed(0)
            built = getattr(classes, class_name)(config)
            from paddle.distributed.fleet.utils.sequence_parallel_utils import is_sequence_parallel_parameter

            return {"moe_layers": _moe_layers(built),
                    "sequence_parallel_marked": [n for n, p in built.named_parameters()
                                                 if is_sequence_parallel_parameter(p)]}

        return _attempt(build)

    qwen3 = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                 mlp_only_layers=[])
    glm4 = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                first_k_dense_replace=1, n_group=1, topk_group=1)
    cases = {
        "qwen3_moe alltoall": model("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated",
                                    meta=dict(moe_token_dispatcher_type="alltoall"), **qwen3),
        "qwen3_moe deepep": model("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated", **qwen3),
        "qwen3_moe alltoall without sequence parallel": model(
            "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLMDeprecated",
            meta=dict(moe_token_dispatcher_type="alltoall", sequence_parallel=False), **qwen3),
        "glm4_moe unified alltoall": model("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated",
                                           meta=dict(moe_token_dispatcher_type="alltoall", use_unified_moe=True),
                                           **glm4),
        "glm4_moe without use_unified_moe": model("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLMDeprecated",
                                                  meta=dict(moe_token_dispatcher_type="alltoall"), **glm4),
        "qwen2_moe": model("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLMDeprecated", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        "deepseek_v3": model("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", first_k_dense_replace=1,
                             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                             n_group=1, topk_group=1,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "factor": 1.0}),
    }
    save_result({"rank": dist.get_rank(), "cases": cases})


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "refusals":
        refusals()
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
