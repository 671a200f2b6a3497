import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import paddle  # noqa: E402

import paddle_hybrid  # noqa: E402,F401  (loads the ops, installs the plugin)


@pytest.fixture(autouse=True)
def _dygraph_cpu():
    """Every test starts in dygraph on CPU and leaves it that way."""
    paddle.disable_static()
    paddle.set_device("cpu")
    yield
    paddle.disable_static()


@pytest.fixture
def repo_root():
    return ROOT


@pytest.fixture
def plugin_restored():
    """Whatever a test does to the registry, the plugin is installed as before afterwards."""
    config = paddle_hybrid.current_config()
    yield
    paddle_hybrid.uninstall()
    paddle_hybrid.install(config)
