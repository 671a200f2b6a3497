import pytest

import paddle_hybrid
from paddle_hybrid import cpu


@pytest.fixture
def fresh_plugin():
    """The cpu component alone uninstalled; reinstalled as it was afterwards."""
    was_active = cpu.is_active()
    cpu.uninstall()
    yield
    cpu.uninstall()
    if was_active:
        cpu.install(paddle_hybrid.current_config())
