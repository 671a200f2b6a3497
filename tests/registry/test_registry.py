"""The one registry of Paddle patches (paddle_hybrid.catalog.install): version policy, all or none,
whole uninstall, report."""
import importlib
import warnings

import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.catalog import install as _install
from paddle_hybrid.registry.patching import _MISSING  # "the attribute did not exist before"


def _value(owner, name):
    return vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)


def _owner_of(entry_component, owner_name, name):
    for component in _install.COMPONENTS:
        if component.name == entry_component and component.patcher is not None:
            for owner, n, _, _ in component.patcher.changes():
                if n == name and getattr(owner, "__name__", repr(owner)) == owner_name:
                    return owner
    raise AssertionError((entry_component, owner_name, name))


def _snapshot():
    """(owner, name) -> (Paddle's original, the installed replacement) of every attribute the
    plugin replaced.  Two components may wrap one attribute (both fleet_fixes and grad_buckets
    wrap ``_hybrid_sync_grad``): the first one's original is Paddle's, the last one's
    replacement is what is installed."""
    out = {}
    for entry in paddle_hybrid.patches():
        owner = _owner_of(entry["component"], entry["owner"], entry["name"])
        original = out.get((owner, entry["name"]), (entry["original"], None))[0]
        out[(owner, entry["name"])] = (original, entry["replacement"])
    return out


def test_uninstall_restores_every_original_and_install_replaces_them(plugin_restored):
    changed = _snapshot()
    assert len(changed) >= 40  # cpu alone replaces 38 on a CPU build
    for (owner, name), (_, replacement) in changed.items():
        assert _value(owner, name) is replacement, (owner, name)
    paddle_hybrid.uninstall()
    assert paddle_hybrid.installed_components() == [] and paddle_hybrid.patches() == []
    for (owner, name), (original, _) in changed.items():
        assert _value(owner, name) is original, (owner, name)
    # Paddle's own state a component changed without an attribute: fleet's meta optimizer list
    from paddle.distributed.fleet.base import meta_optimizer_factory as factory
    assert "FusedAllreduceOptimizer" not in factory.meta_optimizer_names


def test_install_after_uninstall_reads_the_environment_again(plugin_restored, monkeypatch):
    paddle_hybrid.uninstall()
    monkeypatch.setenv("PADDLE_HYBRID_GRAD_BUCKETS", "0")
    paddle_hybrid.install()
    assert paddle_hybrid.current_config().grad_buckets is False
    assert "grad_buckets" not in paddle_hybrid.installed_components()
    assert "grad_buckets           off: switched off" in paddle_hybrid.report()


def test_unverified_paddle_skips_every_component_with_a_warning(plugin_restored, monkeypatch):
    """``import paddle_hybrid`` on a Paddle nothing was verified on: no error, nothing patched,
    one warning per wanted component naming the version and the force switch."""
    paddle_hybrid.uninstall()
    monkeypatch.setattr(paddle, "__version__", "9.9.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paddle_hybrid.install(PluginConfig())
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert paddle_hybrid.installed_components() == [] and paddle_hybrid.patches() == []
    for name in ("cpu", "grad_buckets", "fused_allreduce", "send_wait", "fleet_fixes"):
        assert any(f"{name}: verified on Paddle" in m and "this is 9.9.0" in m
                   and f"PADDLE_HYBRID_FORCE={name}" in m for m in messages), (name, messages)
    assert "cpu                    skipped: cpu: verified on Paddle 3.2.x/3.3.x" in paddle_hybrid.report()
    # forcing one component installs that one only
    paddle_hybrid.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paddle_hybrid.install(PluginConfig(force_unverified=("fleet_fixes",)))
    assert paddle_hybrid.installed_components() == ["fleet_fixes"]


def test_a_failing_component_rolls_back_everything_installed_before_it(plugin_restored, monkeypatch):
    changed = _snapshot()
    paddle_hybrid.uninstall()
    failing = importlib.import_module("paddle_hybrid.dygraph.cuda_graph.pipeline")
    from paddle_hybrid.dygraph.cuda_graph import COMPONENT

    def broken_apply(config, patcher):
        patcher.set(failing, "_probe", 1)
        raise KeyError("simulated failure")

    monkeypatch.setattr(COMPONENT, "apply", broken_apply)
    with pytest.raises(paddle_hybrid.InstallError, match=r"installing cuda_graph failed: "
                                                        r"'simulated failure'\. Nothing of the plugin is installed"):
        paddle_hybrid.install(PluginConfig())
    assert paddle_hybrid.installed_components() == [] and paddle_hybrid.current_config() is None
    assert not hasattr(failing, "_probe")
    for (owner, name), (original, _) in changed.items():  # the components before it were undone
        assert _value(owner, name) is original, (owner, name)


def test_bad_force_name_is_refused(plugin_restored):
    paddle_hybrid.uninstall()
    with pytest.raises(ValueError, match=r"PADDLE_HYBRID_FORCE .* names \['cpuu'\], which are not components"):
        paddle_hybrid.install(PluginConfig(force_unverified=("cpuu",)))


def test_report_names_every_component():
    text = paddle_hybrid.report()
    for component in _install.COMPONENTS:
        assert f"  {component.name} " in text
    assert f"on Paddle {paddle.__version__}" in text
