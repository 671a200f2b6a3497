"""In-process: the cpu component makes every TCP store of the job a classic one
(``FLAGS_tcp_store_using_libuv`` False), restores Paddle's value when uninstalled, and leaves a
value the user set in the environment alone.

Why (``paddle_hybrid/dygraph/cpu/tcp_store.py``): the libuv server aborted a rank at exit in 2 of
15 four-rank runs; with the classic server 0 of 40.  Before the concern the flag stayed True
under the plugin (the first assertion failed)."""
import paddle

import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph.cpu import tcp_store
from paddle_hybrid.registry.patching import Patcher


def _flag():
    return paddle.get_flags([tcp_store.FLAG])[tcp_store.FLAG]


def test_the_plugin_chooses_the_classic_store_and_uninstall_gives_it_back(fresh_plugin, monkeypatch):
    monkeypatch.delenv(tcp_store.FLAG, raising=False)
    stock = _flag()
    assert stock is True  # Paddle's default on 3.2 and 3.3: the libuv server
    paddle_hybrid.install_component("cpu", PluginConfig(cpu_hybrid="on"))
    assert _flag() is False
    paddle_hybrid.uninstall_component("cpu")
    assert _flag() is stock


def test_a_users_own_setting_is_kept(monkeypatch):
    """As if the user had started with FLAGS_tcp_store_using_libuv=1: the concern leaves it True."""
    monkeypatch.setenv(tcp_store.FLAG, "1")
    before = _flag()
    paddle.set_flags({tcp_store.FLAG: True})
    patcher = Patcher("test", "PADDLE_HYBRID_CPU")
    try:
        tcp_store.apply(patcher)
        assert _flag() is True
    finally:
        patcher.revert()
        paddle.set_flags({tcp_store.FLAG: before})
