"""``--shrink-from`` on MoE configurations (Qwen3-MoE, GLM4-MoE, DeepSeek-V3, ERNIE-4.5-MoE; the fields
written here from the public configurations, nothing downloaded), for the expert-parallel layouts a
Trainer script takes (``epN``: EP over the tensor-parallel ranks with sequence parallel): the experts
(so each rank holds the real experts per rank), top-k, shared experts and routing groups are kept;
the layers that are MoE keep the real model's shape (dense layers first where it has them, at least
one MoE layer); the routed experts' width is small; what cannot route as the real model is refused.

Seen failing first: the kept fields had no row in the printed configuration (``Shrunk.field`` found no
``num_experts_per_tok``, ``n_group``, ``moe_num_shared_experts``...); ERNIE-4.5-MoE kept
``moe_layer_end_index`` 27 in a 2-layer model; Qwen3-MoE with ``decoder_sparse_step`` 4 shrunk to 2
layers had no MoE layer; DeepSeek-V3's 256 experts at ep8 had ``moe_intermediate_size`` 296 (233 M
parameters an MoE layer, in the one-process run; 25 M at 32); groups that do not split the experts,
and a top-k beyond what the chosen groups offer, were not refused.
"""
import pytest

from paddle_hybrid.verify import shrink
from paddle_hybrid.verify.layouts import Layout, for_kind

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "head_dim": 128, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936, "rope_theta": 1000000.0}
GLM_45_AIR = {"model_type": "glm4_moe", "hidden_size": 4096, "head_dim": 128, "num_attention_heads": 96,
              "num_key_value_heads": 8, "intermediate_size": 10944, "moe_intermediate_size": 1408,
              "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
              "first_k_dense_replace": 1, "num_hidden_layers": 46, "vocab_size": 151552, "routed_scaling_factor": 1.0}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_hidden_layers": 61, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280, "topk_method": "noaux_tc", "routed_scaling_factor": 2.5}
ERNIE_45_21B_A3B = {"model_type": "ernie4_5_moe", "hidden_size": 2560, "head_dim": 128, "num_attention_heads": 20,
                    "num_key_value_heads": 4, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                    "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_k": 6, "moe_layer_start_index": 1,
                    "moe_layer_end_index": 27, "moe_layer_interval": 1, "moe_capacity": [64, 64, 64],
                    "num_hidden_layers": 28, "vocab_size": 103424, "tie_word_embeddings": True}
# family: (config, layout, experts field, top-k field, shared field, the real model's layers: dense first?)
CASES = {
    "qwen3_moe": (QWEN3_30B_A3B, "ep4", "num_experts", "num_experts_per_tok", None, False),
    "glm4_moe": (GLM_45_AIR, "ep8", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", True),
    "deepseek_v3": (DEEPSEEK_V3, "ep8", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", True),
    "ernie4_5_moe": (ERNIE_45_21B_A3B, "ep4", "moe_num_experts", "moe_k", "moe_num_shared_experts", True),
}


def _shrunk(config, name):
    return shrink.shrink(config, [for_kind("trainer", Layout(name))], sequence=16)


@pytest.mark.parametrize("family", list(CASES))
def test_experts_top_k_shared_experts_and_groups_are_kept(family):
    config, name, experts, top_k, shared, dense_first = CASES[family]
    shrunk = _shrunk(config, name)
    got, ep = shrunk.config, int(name[2:])
    for field in filter(None, (experts, top_k, shared, "n_group", "topk_group")):
        if field in config:
            assert got[field] == config[field], field
            assert "kept" in shrunk.field(field).why, shrunk.describe()
    assert got[experts] // ep == config[experts] // ep and got[experts] % ep == 0  # the real experts per rank
    assert f"{config[experts] // ep} per rank at ep{ep}" in shrunk.field(experts).why
    layers = shrink.moe_layers(got)
    assert layers and got["num_hidden_layers"] == 2, (layers, got["num_hidden_layers"])
    assert layers == ([1] if dense_first else [0, 1]), layers  # dense first as the real model, one MoE layer at least
    assert got["moe_intermediate_size"] <= shrink.EXPERT_FFN_CAP and got["moe_intermediate_size"] % ep == 0
    assert "MoE layers" in shrunk.describe()


def test_routing_groups_at_the_expert_parallel_degree():
    text = _shrunk(DEEPSEEK_V3, "ep8").describe()
    assert "8 groups of 32 experts" in text and "top 4 groups" in text, text
    got = _shrunk(ERNIE_45_21B_A3B, "ep4").config
    assert (got["moe_layer_start_index"], got["moe_layer_end_index"]) == (1, 1)
    assert got["moe_capacity"] == [64, 64, 64]  # not one entry a layer: as is


def test_moe_layer_spacing_keeps_a_moe_layer():
    got = _shrunk(dict(QWEN3_30B_A3B, decoder_sparse_step=4, mlp_only_layers=[0, 47]), "ep4").config
    assert got["mlp_only_layers"] == [0] and shrink.moe_layers(got) == [1], got
    got = _shrunk(dict(DEEPSEEK_V3, moe_layer_freq=2), "ep8").config
    assert shrink.moe_layers(got) == [1], got


@pytest.mark.parametrize("change, reason", [
    ({"n_group": 6}, "256 experts do not split into 6 routing groups"),
    ({"topk_group": 9}, "topk_group 9 of 8 routing groups"),
    ({"topk_group": 1, "num_experts_per_tok": 40}, "top-40 over 1 of 8 groups of 32 experts"),
])
def test_routing_the_real_model_cannot_do_is_refused(change, reason):
    with pytest.raises(shrink.ShrinkError, match=reason):
        _shrunk(dict(DEEPSEEK_V3, **change), "ep8")
