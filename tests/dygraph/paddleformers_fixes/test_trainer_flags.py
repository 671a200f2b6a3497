"""The Trainer's precision and recompute flags on CPU (``paddleformers_fixes.cpu_precision``,
``paddleformers_fixes.recompute_flags``): ``--bf16`` stops at the start naming the flag (stock:
it trains float32 to the end with only a log line, asserted first); the recompute flags make
LLaMA recompute (stock: zero recompute calls, asserted first)."""
import os
import sys
import types

import pytest

from paddle_hybrid.dygraph.paddleformers_fixes import cpu_precision, recompute_flags
from paddle_hybrid.testing import LaunchError
from test_paddleformers_llama import paddleformers_version  # noqa: F401  (the fixture)
from test_trainer import SCRIPT, run

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = ["--bf16", "false", "--fp16", "false", "--amp_master_grad", "false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, paddleformers_version):
    import subprocess

    from test_trainer import _env

    work = str(tmp_path_factory.mktemp("flags"))
    model = os.path.join(work, "tiny-llama")
    subprocess.run([sys.executable, SCRIPT, "write-tiny-model", model], env=_env(), check=True, capture_output=True,
                   timeout=300)
    return work, model


def _one(tiny, name, flags, env=None, wrapper=None):
    work, model = tiny
    output = []
    try:
        run(work, name, 1, flags, model, env_extra=env, wrapper=wrapper, output=output)
        return True, output[0]
    except LaunchError as exc:
        return False, str(exc)


def test_bf16_on_cpu_stops_at_the_start_naming_the_flag(tiny):
    bf16 = ["--max_steps", "1", "--bf16", "true"]
    ok, _ = _one(tiny, "bf16_stock", bf16, env={"PADDLE_HYBRID_PADDLEFORMERS_FIXES": "0"})
    assert ok  # stock: a float32 run to the end, as if bf16 had been honoured
    ok, text = _one(tiny, "bf16", bf16)
    assert not ok and "CpuPrecisionError: --bf16 on a CPU device" in text and "--fp16 false --bf16 false" in text


def test_recompute_flags_make_llama_recompute(tiny):
    flags = ["--max_steps", "1", "--recompute_granularity", "full", "--recompute_method", "uniform",
             "--recompute_num_layers", "1"]
    wrapper = os.path.join(HERE, "count_recompute.py")
    ok, text = _one(tiny, "rc_stock", flags, env={"PADDLE_HYBRID_PADDLEFORMERS_FIXES": "0"}, wrapper=wrapper)
    assert ok and "recompute calls: 0" in text, text[-2000:]
    ok, text = _one(tiny, "rc", flags, wrapper=wrapper)
    calls = int(text.split("recompute calls: ")[1].split()[0])
    assert ok and calls >= 2, text[-2000:]  # every decoder layer of each micro-batch (2 layers)


def test_precision_check_on_an_accelerator_is_silent(monkeypatch):
    monkeypatch.setattr(cpu_precision, "on_cpu", lambda args: False)
    cpu_precision.check(types.SimpleNamespace(fp16=True, bf16=False, device="gpu"))
    with pytest.raises(cpu_precision.CpuPrecisionError, match="--fp16 on a CPU device"):
        monkeypatch.setattr(cpu_precision, "on_cpu", lambda args: True)
        cpu_precision.check(types.SimpleNamespace(fp16=True, bf16=False, device="cpu"))


def test_recompute_flags_never_override_a_config_value():
    args = types.SimpleNamespace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = types.SimpleNamespace(config=types.SimpleNamespace(recompute_granularity=None, recompute_method=None,
                                                               recompute_num_layers=None))
    assert recompute_flags.carry(args, model) == list(recompute_flags.FLAGS)
    assert model.config.recompute_method == "uniform"
    model.config.recompute_num_layers = 2
    args.recompute_num_layers = 1
    with pytest.raises(ValueError, match="recompute_num_layers=2"):
        recompute_flags.carry(args, model)


def test_auto_parallel_layout_check_names_only_tensor_parallelism(monkeypatch):
    from paddle_hybrid.dygraph.paddleformers_fixes import auto_parallel_layouts as layouts

    def args(**kw):
        return types.SimpleNamespace(**{"enable_auto_parallel": True, "tensor_model_parallel_size": 2,
                                        "use_intermediate_api": False, "device": "cpu", **kw})

    monkeypatch.setattr(layouts, "on_cpu", lambda a: True)
    with pytest.raises(layouts.AutoParallelLayoutError, match="--tensor_model_parallel_size 2"):
        layouts.check(args())
    layouts.check(args(tensor_model_parallel_size=-1))  # no TP (PaddleFormers' default)
    layouts.check(args(enable_auto_parallel=False))  # fleet's TP
    layouts.check(args(use_intermediate_api=True))  # Paddle's own parallelize: not this finding
    monkeypatch.setattr(layouts, "on_cpu", lambda a: False)
    layouts.check(args(device="gpu"))  # not seen on an accelerator: left alone
