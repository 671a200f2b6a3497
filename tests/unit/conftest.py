import pytest

import paddle_hybrid


@pytest.fixture
def plugin_restored():
    """Whatever a test does to the registry, the plugin is installed as before afterwards."""
    config = paddle_hybrid.current_config()
    yield
    paddle_hybrid.uninstall()
    paddle_hybrid.install(config)
