"""In-process: the cpu component makes every TCP store of the job a classic one
(``FLAGS_tcp_store_using_libuv`` False), restores Paddle's value when uninstalled, and leaves a
value the user set in the environment alone.  Paddle 3.2 has no libuv store (nor the flag): there
the concern's only change is its other part, the wrapper that turns Nagle off on the store
(tested in ``test_store_nodelay.py``).

Why (``paddle_hybrid/gloo/tcp_store.py``): the libuv server aborted a rank at exit now and
then, each core dump in its read callback; the classic server has no such path.  Before the concern the flag stayed True
under the plugin (the first assertion failed)."""
import paddle

import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.gloo import tcp_store
from paddle_hybrid.registry.patching import Patcher


def _flag():
    """The flag's value; None on a Paddle without it."""
    try:
        return paddle.get_flags([tcp_store.FLAG])[tcp_store.FLAG]
    except ValueError:
        return None


def test_the_plugin_chooses_the_classic_store_and_uninstall_gives_it_back(fresh_plugin, monkeypatch):
    monkeypatch.delenv(tcp_store.FLAG, raising=False)
    stock = _flag()
    if stock is None:  # Paddle 3.2: no libuv store, nothing to choose
        assert not paddle.__version__.startswith("3.3."), "Paddle 3.3 has the flag"
        from paddle.base import core

        patcher = Patcher("test", "PADDLE_HYBRID_CPU")
        try:
            tcp_store.apply(PluginConfig(), patcher)
            assert patcher.patched() == [(core, "create_or_get_global_tcp_store")]  # no flag set
        finally:
            patcher.revert()
        return
    assert stock is True  # Paddle 3.3's default: the libuv server
    paddle_hybrid.install_component("cpu", PluginConfig(cpu="on"))
    assert _flag() is False
    paddle_hybrid.uninstall_component("cpu")
    assert _flag() is stock


def test_a_users_own_setting_is_kept(monkeypatch):
    """As if the user had started with FLAGS_tcp_store_using_libuv=1: the concern leaves it True."""
    before = _flag()
    if before is None:
        assert not paddle.__version__.startswith("3.3."), "Paddle 3.3 has the flag"
        return  # no flag: the first test shows the concern changes nothing
    monkeypatch.setenv(tcp_store.FLAG, "1")
    paddle.set_flags({tcp_store.FLAG: True})
    patcher = Patcher("test", "PADDLE_HYBRID_CPU")
    try:
        tcp_store.apply(PluginConfig(), patcher)
        assert _flag() is True
    finally:
        patcher.revert()
        paddle.set_flags({tcp_store.FLAG: before})
