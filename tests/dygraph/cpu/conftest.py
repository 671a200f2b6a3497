import pytest

import paddle_hybrid
from paddle_hybrid.dygraph import cpu


@pytest.fixture
def fresh_plugin():
    """The cpu component alone uninstalled; reinstalled as it was afterwards."""
    was_active = cpu.is_active()
    paddle_hybrid.uninstall_component("cpu")
    yield
    paddle_hybrid.uninstall_component("cpu")
    if was_active:
        paddle_hybrid.install_component("cpu", paddle_hybrid.current_config())
