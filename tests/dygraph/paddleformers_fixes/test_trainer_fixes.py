"""One-process checks of what the PaddleFormers Trainer on CPU needs from the plugin: each seen
failing with the plugin uninstalled (the stock behaviour is asserted first where it is an error)."""
import sys
import types

import numpy as np
import pytest

import paddle
import paddle_hybrid
from paddle_hybrid.dygraph.fleet_fixes.tied_optimizer_state import add_tied_names
from paddle_hybrid.common.import_hook import when_imported


@pytest.fixture
def plugin():
    paddle_hybrid.uninstall()
    yield
    paddle_hybrid.install()


def test_synchronize_on_cpu_place(plugin):
    paddle.set_device("cpu")
    with pytest.raises(TypeError, match="device should be"):
        paddle.device.synchronize()
    paddle_hybrid.install()
    assert paddle.device.synchronize() is None
    assert paddle.device.synchronize("cpu") is None


def _call_cuda_as(module_name, tensor):
    """``tensor.cuda()`` from a function whose module is ``module_name``."""
    scope = {"__name__": module_name}
    exec("def move(t):\n    return t.cuda()\n", scope)
    return scope["move"](tensor)


def test_cuda_answers_host_copy_only_for_flex_checkpoint(plugin):
    if paddle.is_compiled_with_cuda():
        pytest.skip("a CUDA build: .cuda() is Paddle's")
    t = paddle.to_tensor(np.arange(6, dtype="float32"))
    with pytest.raises(ValueError):  # 3.3: "No available device found"; 3.2: "use wrong place"
        _call_cuda_as("paddle.distributed.flex_checkpoint.dcp.reshard_comm", t)
    paddle_hybrid.install()
    copy = _call_cuda_as("paddle.distributed.flex_checkpoint.dcp.reshard_comm", t)
    assert copy.place.is_cpu_place() and copy is not t
    np.testing.assert_array_equal(copy.numpy(), t.numpy())
    copy[0] = 100.0  # a copy, as .cuda() returns one
    assert float(t[0]) == 0.0
    with pytest.raises(ValueError):  # anyone else: Paddle's answer
        _call_cuda_as("user_script", t)


class _Weight:
    def __init__(self, key, name, shape, offset):
        self.key, self.global_shape, self.global_offset = key, shape, offset
        self.local_tensor = types.SimpleNamespace(name=name)


def test_tied_weight_state_under_every_name():
    model = {"lm_head.weight": _Weight("lm_head.weight", "w0", (8, 4), (0, 0)),
             "model.embed_tokens.weight": _Weight("model.embed_tokens.weight", "w0", (8, 4), (0, 0)),
             "model.norm.weight": _Weight("model.norm.weight", "w1", (4,), (0,))}
    state = {"lm_head.weight.moment1_0": _Weight("lm_head.weight.moment1_0", "m", (8, 4), (0, 0)),
             "lm_head.weight.beta1_pow_acc_0": _Weight("lm_head.weight.beta1_pow_acc_0", "b", (1,), (0,)),
             "model.norm.weight.moment1_0": _Weight("model.norm.weight.moment1_0", "n", (4,), (0,))}
    out = add_tied_names(state, model)
    assert sorted(out) == sorted([*state, "model.embed_tokens.weight.moment1_0",
                                  "model.embed_tokens.weight.beta1_pow_acc_0"])
    twin = out["model.embed_tokens.weight.moment1_0"]
    assert twin.key == "model.embed_tokens.weight.moment1_0"
    assert twin.local_tensor is state["lm_head.weight.moment1_0"].local_tensor


def test_when_imported_runs_after_the_first_import(tmp_path, monkeypatch):
    (tmp_path / "ph_probe_pkg").mkdir()
    (tmp_path / "ph_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "ph_probe_pkg" / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    cancel = when_imported("ph_probe_pkg.mod", lambda m: seen.append(m.VALUE))
    try:
        assert seen == []
        import ph_probe_pkg.mod  # noqa: F401

        assert seen == [1]
        when_imported("ph_probe_pkg.mod", lambda m: seen.append("now"))  # already imported: at once
        assert seen == [1, "now"]
    finally:
        cancel()
        for name in ("ph_probe_pkg.mod", "ph_probe_pkg"):
            sys.modules.pop(name, None)
    assert not any(type(f).__name__ == "_PostImportFinder" and f.name == "ph_probe_pkg.mod" for f in sys.meta_path)
