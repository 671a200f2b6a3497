"""ERNIE-4.5-MoE with its experts over the TP group and no sequence parallelism is refused when the model
is built (it routed every token once per TP rank: losses equal to one process's, step-1 gradients 4.1e-2
of the largest off at TP2; ``paddle_hybrid/dygraph/paddleformers_fixes/ernie_moe_layouts.py``).

Seen failing first: without the check, ``Ernie4_5_MoeModel(config)`` at tensor_model_parallel_size 2
without sequence parallelism went on building (and trained wrong) instead of naming the flag."""
import types

import pytest

pytest.importorskip("paddleformers")

from paddle_hybrid.dygraph.paddleformers_fixes import ernie_moe_layouts  # noqa: E402
from paddle_hybrid.dygraph.paddleformers_fixes.moe_dispatcher import ExpertParallelRefused  # noqa: E402


def _config(**kw):
    base = dict(moe_group="mp", tensor_model_parallel_size=2, moe_num_experts=4, sequence_parallel=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("group", ["mp", "model", "tp"])
def test_experts_over_tp_without_sequence_parallel_are_refused_by_name(group):
    with pytest.raises(ExpertParallelRefused, match="--sequence_parallel true") as info:
        ernie_moe_layouts.check(_config(moe_group=group))
    assert "routed 2 times" in str(info.value) and '"dp"' in str(info.value)


@pytest.mark.parametrize("changes", [dict(sequence_parallel=True), dict(moe_group="dp"), dict(moe_group="dummy"),
                                     dict(tensor_model_parallel_size=1), dict(moe_num_experts=0),
                                     dict(moe_num_experts=[0, 0])])
def test_what_routes_each_token_once_passes(changes):
    ernie_moe_layouts.check(_config(**changes))  # no exception


def test_the_model_is_refused_before_it_is_built(plugin_restored):
    """Through the plugin (installed by the suite): ``Ernie4_5_MoeModel.__init__`` checks first (nothing of
    the model is built, no process group is asked for), and ``uninstall()`` takes the check away."""
    import paddle_hybrid
    from paddleformers.transformers.ernie4_5_moe import modeling

    config = modeling.Ernie4_5_MoeConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         moe_num_experts=4, moe_group="mp", tensor_model_parallel_size=2,
                                         sequence_parallel=False, vocab_size=64, intermediate_size=64)
    with pytest.raises(ExpertParallelRefused):
        modeling.Ernie4_5_MoeModel(config)
    paddle_hybrid.uninstall()
    assert modeling.Ernie4_5_MoeModel.__init__.__module__ != ernie_moe_layouts.__name__
