"""What moved or was renamed keeps working, with a DeprecationWarning naming the new place:
import paths (``paddle_hybrid._moved``), and PluginConfig's renamed fields and environment
variables (``paddle_hybrid.config.RENAMED``).  Each import check runs in a fresh process: a module
imported once is cached, and the second import would not warn."""
import json
import subprocess
import sys
import warnings

import pytest

from paddle_hybrid.config import PluginConfig

IMPORT_CHECK = r"""
import json, sys, warnings
warnings.simplefilter("always")
import paddle_hybrid
old, new, name = sys.argv[1:4]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old_value = getattr(__import__(old, fromlist=[name]), name)
import importlib
new_value = getattr(importlib.import_module(new), name)
print("RESULT " + json.dumps({"same": old_value is new_value,
                              "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning]}))
"""


@pytest.mark.parametrize("old, new, name", [
    ("paddle_hybrid.send_wait", "paddle_hybrid.static.send_wait", "check_send_lifetimes"),
    ("paddle_hybrid.program_edit", "paddle_hybrid.common.program_edit", "deferred_sync"),
    ("paddle_hybrid.dygraph.cpu.gloo_errors", "paddle_hybrid.gloo.errors", "GlooTimeoutError"),
    ("paddle_hybrid.registry.install", "paddle_hybrid.catalog.install", "report"),
    ("paddle_hybrid.cpu.groups", "paddle_hybrid.gloo.groups", "pair_group"),
])
def test_old_import_path_warns_and_gives_the_same_object(old, new, name):
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK, old, new, name], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["same"]
    assert any(f"{old} moved to {new}" in w for w in result["warnings"]), result["warnings"]


def test_a_name_that_never_existed_still_fails():
    out = subprocess.run([sys.executable, "-c", "import paddle_hybrid; import paddle_hybrid.no_such_module"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr


def test_renamed_keyword_and_attribute():
    with pytest.warns(DeprecationWarning, match=r"PluginConfig\(cpu_hybrid=...\) is deprecated; use PluginConfig\(cpu=...\)"):
        old = PluginConfig(cpu_hybrid="off", pipeline_send_wait=False)
    assert old == PluginConfig(cpu="off", send_wait=False)
    with pytest.warns(DeprecationWarning, match=r"PluginConfig.startup_agreement is deprecated; use PluginConfig.agreement"):
        assert old.startup_agreement is True
    with pytest.raises(ValueError, match="both given"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            PluginConfig(cpu_hybrid="off", cpu="on")


def test_renamed_environment_variables(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("PADDLE_HYBRID_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PADDLE_HYBRID_CPU_HYBRID", "off")
    monkeypatch.setenv("PADDLE_HYBRID_STARTUP_AGREEMENT", "0")
    with pytest.warns(DeprecationWarning, match="PADDLE_HYBRID_CPU_HYBRID is deprecated; use PADDLE_HYBRID_CPU"):
        config = PluginConfig.from_env()
    assert config.cpu == "off" and config.agreement is False
    monkeypatch.setenv("PADDLE_HYBRID_CPU", "on")
    with pytest.raises(ValueError, match="PADDLE_HYBRID_CPU_HYBRID \\(deprecated\\) and PADDLE_HYBRID_CPU are both set"):
        PluginConfig.from_env()


def test_meta_optimizers_switch_turns_both_static_components_off(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("PADDLE_HYBRID_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PADDLE_HYBRID_META_OPTIMIZERS", "0")
    with pytest.warns(DeprecationWarning, match="PADDLE_HYBRID_FUSED_ALLREDUCE=0 and PADDLE_HYBRID_SEND_WAIT=0"):
        config = PluginConfig.from_env()
    assert config.fused_allreduce is False and config.send_wait is False
    with pytest.warns(DeprecationWarning):
        assert PluginConfig(register_meta_optimizers=False) == config


def test_old_component_name_in_force_list(plugin_restored):
    import paddle_hybrid

    paddle_hybrid.uninstall()
    with pytest.warns(DeprecationWarning, match="named \\['cuda_graph'\\] now"):
        config = paddle_hybrid.install(PluginConfig(force_unverified=("cuda_graph.pipeline",)))
    assert config.force_unverified == ("cuda_graph",)
