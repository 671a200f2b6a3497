"""In-process tests of paddle_hybrid.dygraph.cpu: install/uninstall, version and config checks."""
import pytest

import paddle
import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph import cpu
from paddle_hybrid.gloo import groups


def _modules():
    import paddle.distributed.collective as collective
    import paddle.distributed.parallel as parallel
    from paddle.distributed.fleet.base import topology
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    return parallel, topology, p2p, collective


def _targets():
    parallel, topology, p2p, collective = _modules()
    return {
        "new_pg_impl": collective._new_process_group_impl,
        "device_id": vars(parallel.ParallelEnv)["device_id"],
        "hcg_init": topology.HybridCommunicateGroup.__init__,
        "p2p_ops": p2p._p2p_ops,
        "batched": p2p._batched_p2p_ops,
        "send_meta": p2p.SendRecvMeta.send_meta,
        "recv_meta": p2p.SendRecvMeta.recv_meta,
    }


def test_install_patches_and_uninstall_restores(fresh_plugin):
    stock = _targets()
    assert not cpu.is_active()
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    patched = _targets()
    for k in ("device_id", "new_pg_impl", "hcg_init", "p2p_ops", "batched", "send_meta", "recv_meta"):
        assert patched[k] is not stock[k], k
    assert paddle.distributed.ParallelEnv().device_id == 0
    paddle_hybrid.uninstall_component("cpu")
    assert _targets() == stock
    assert not cpu.is_active()


def test_off_and_auto_on_cpu_build(fresh_plugin):
    stock = _targets()
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="off"))
    assert _targets() == stock
    paddle_hybrid.uninstall_component("cpu")
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="auto"))
    assert cpu.is_active() == (not paddle.is_compiled_with_cuda())


def test_unexpected_paddle_version(fresh_plugin, monkeypatch):
    """An unverified Paddle: skipped with a warning naming the version and the switch; forced
    with PluginConfig(force_unverified=("cpu",))."""
    stock = _targets()
    monkeypatch.setattr(paddle, "__version__", "9.9.0")
    with pytest.warns(RuntimeWarning, match=r"verified on Paddle 3\.2\.x/3\.3\.x, this is 9\.9\.0; skipped\. "
                                            r"Set PADDLE_HYBRID_FORCE=cpu"):
        state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    assert state.status == "skipped" and _targets() == stock and not cpu.is_active()
    state = paddle_hybrid.install_component("cpu", PluginConfig(cpu="on", force_unverified=("cpu",)))
    assert state.status == "active" and cpu.is_active() and _targets() != stock
    paddle_hybrid.uninstall_component("cpu")
    assert _targets() == stock


def test_changed_signature_refused_before_any_change(fresh_plugin, monkeypatch):
    parallel, topology, p2p, collective = _modules()
    monkeypatch.setattr(p2p, "_p2p_ops", lambda a, b: None)
    stock = _targets()
    with pytest.raises(cpu.PatchSignatureError, match="_p2p_ops has parameters"):
        paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    # concerns applied before p2p (device, groups) were rolled back too
    assert _targets() == stock and not cpu.is_active()


def test_config_validation(monkeypatch):
    with pytest.raises(ValueError, match="cpu must be 'auto', 'on' or 'off'"):
        PluginConfig(cpu="yes")
    with pytest.raises(ValueError, match="grad_bucket_max_params"):
        PluginConfig(grad_bucket_max_params=-1)
    monkeypatch.setenv("PADDLE_HYBRID_CPU", "ON")
    monkeypatch.setenv("PADDLE_HYBRID_GRAD_BUCKET_MAX_PARAMS", "7")
    cfg = PluginConfig.from_env()
    assert cfg.cpu == "on" and cfg.grad_bucket_max_params == 7
    monkeypatch.setenv("PADDLE_HYBRID_GRAD_BUCKET_MAX_PARAMS", "many")
    with pytest.raises(ValueError, match="not an integer"):
        PluginConfig.from_env()


def test_ring_pairs():
    class Topo:
        def __init__(self, lists):
            self.lists = lists

        def get_comm_list(self, name):
            assert name == "pipe"
            return self.lists

    assert groups.pair_list(Topo([[0, 1]])) == [(0, 1)]
    assert groups.pair_list(Topo([[0, 1, 2]])) == [(0, 1), (1, 2), (0, 2)]
    assert groups.pair_list(Topo([[0, 2], [1, 3]])) == [(0, 2), (1, 3)]


def test_every_patched_attribute_is_restored(fresh_plugin):
    """Whatever the concerns replace (cpu.patched()), uninstall puts the original back."""
    def value(owner, name):
        return vars(owner).get(name, "<missing>") if isinstance(owner, type) else getattr(owner, name, "<missing>")

    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    targets = cpu.patched()
    assert len(targets) >= 25, targets  # device, groups, p2p, collectives, tp, sharding, recompute, timers, vp
    paddle_hybrid.uninstall_component("cpu")
    stock = [value(owner, name) for owner, name in targets]
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    assert all(value(o, n) is not s for (o, n), s in zip(targets, stock))
    paddle_hybrid.uninstall_component("cpu")
    assert all(value(o, n) is s for (o, n), s in zip(targets, stock))
