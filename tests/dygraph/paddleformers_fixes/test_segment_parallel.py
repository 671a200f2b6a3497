"""The Trainer's segment parallelism (``--sep_parallel_size``) with a PaddleFormers model is refused at
the start (``paddleformers_fixes.segment_parallel``): PaddleFormers 1.2's models run each sep rank's
part of the sequence alone (no attention over the sep group), so sep2 trains other gradients than
one process (the module's docstring has the evidence).  Stock, the 2-rank run trains to the end
without a word (asserted first); with the plugin both ranks stop at ``Trainer.__init__`` naming the
cause and what trains instead."""
import os
import subprocess
import sys
import types

import pytest

from paddle_hybrid.dygraph.paddleformers_fixes import segment_parallel
from paddle_hybrid.testing import LaunchError
from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture: skip / fail / ok)
from test_trainer import SCRIPT, _env, run

SEP2 = ["--max_steps", "1", "--save_strategy", "no", "--sep_parallel_size", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, paddleformers_version):
    work = str(tmp_path_factory.mktemp("sep"))
    model = os.path.join(work, "tiny-llama")
    subprocess.run([sys.executable, SCRIPT, "write-tiny-model", model], env=_env(), check=True, capture_output=True,
                   timeout=300)
    return work, model


def test_sep2_trainer_stops_at_the_start_naming_the_cause(tiny):
    work, model = tiny
    # (stock needs no clipping: its norm hook stops any hybrid-parallel run, paddleformers_fixes.grad_norm_hook)
    stock = run(work, "sep2_stock", 2, [*SEP2, "--max_grad_norm", "0"], model,
                env_extra={"PADDLE_HYBRID_PADDLEFORMERS_FIXES": "0"})
    assert sorted(stock[0]) == [1] and sorted(stock[1]) == [1]  # stock: both ranks train and log, no error
    with pytest.raises(LaunchError) as failure:
        run(work, "sep2", 2, SEP2, model)
    text = str(failure.value)
    assert "SegmentParallelError: --sep_parallel_size 2 with LlamaForCausalLM" in text, text[-3000:]
    assert "no segment-parallel attention" in text and "Drop --sep_parallel_size" in text
    assert not os.path.exists(os.path.join(work, "sep2", "progress.rank0.json"))  # not one step trained


def _args(**kw):
    base = dict(sep_parallel_size=2, enable_auto_parallel=False, split_inputs_sequence_dim=True)
    return types.SimpleNamespace(**{**base, **kw})


def test_which_models_and_flags_are_refused(paddleformers_version):
    from paddleformers.transformers.llama.modeling import LlamaForCausalLM, LlamaForCausalLMPipe
    from paddleformers.transformers.model_utils import PretrainedModel

    class OwnModel(PretrainedModel):  # a model of one's own: its sep attention is its own business
        pass

    class OwnLlama(LlamaForCausalLM):  # LLaMA's attention under another name
        pass

    def instance(cls):
        return cls.__new__(cls)  # the check reads the class only

    for cls in (LlamaForCausalLM, LlamaForCausalLMPipe, OwnLlama):
        with pytest.raises(segment_parallel.SegmentParallelError, match="--sep_parallel_size 2 with"):
            segment_parallel.check(_args(), instance(cls))
    with pytest.raises(segment_parallel.SegmentParallelError, match="2 times one process's"):
        segment_parallel.check(_args(split_inputs_sequence_dim=False), instance(LlamaForCausalLM))
    segment_parallel.check(_args(), instance(OwnModel))
    segment_parallel.check(_args(sep_parallel_size=1), instance(LlamaForCausalLM))
    segment_parallel.check(_args(sep_parallel_size=-1), instance(LlamaForCausalLM))  # unset
    segment_parallel.check(_args(enable_auto_parallel=True), instance(LlamaForCausalLM))  # not this path
