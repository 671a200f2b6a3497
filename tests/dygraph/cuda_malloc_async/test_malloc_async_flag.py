"""PluginConfig.cuda_malloc_async (the component ``cuda_malloc_async``) on the real install path:
the flag is set and restored; a flag this Paddle does not have is named; any other failure is
raised or reported as what it is, never swallowed.  A GPU is faked by monkeypatching Paddle's
device queries (this machine has none)."""
import warnings

import paddle
import pytest

import paddle_hybrid
from paddle_hybrid import PluginConfig

FLAG = "FLAGS_use_cuda_malloc_async_allocator"
COMPONENT = "cuda_malloc_async"
ASYNC_ONLY = PluginConfig(cuda_malloc_async=True)


@pytest.fixture
def reinstall():
    """The component uninstalled for the test, reinstalled with the session's config after it
    (after monkeypatch has put Paddle back: this fixture is set up first, torn down last)."""
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component(COMPONENT)
    yield
    paddle_hybrid.uninstall_component(COMPONENT)
    paddle_hybrid.install_component(COMPONENT, config)


def fake_gpu(monkeypatch, memory_allocated, devices=1):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(paddle.device.cuda, "memory_allocated", memory_allocated)


def test_flag_missing_from_this_paddle_names_the_config_field(reinstall, monkeypatch):
    def get_flags(flags):  # what paddle.get_flags raises for a flag it does not know
        raise ValueError(f"Flag {flags[0]} cannot get its value through this function.")

    monkeypatch.setattr(paddle, "get_flags", get_flags)
    with pytest.raises(RuntimeError, match=f"cuda_malloc_async is set but this Paddle has no {FLAG}"):
        paddle_hybrid.install_component(COMPONENT, ASYNC_ONLY)


def test_other_failure_reading_the_flag_is_raised_as_itself(reinstall, monkeypatch):
    def get_flags(flags):
        raise OSError("flag registry unavailable")

    monkeypatch.setattr(paddle, "get_flags", get_flags)
    with pytest.raises(OSError, match="flag registry unavailable"):
        paddle_hybrid.install_component(COMPONENT, ASYNC_ONLY)


def test_failing_gpu_memory_query_is_reported_and_the_flag_still_set(reinstall, monkeypatch):
    def memory_allocated(device=None):
        raise RuntimeError("CUDA driver: unknown error")

    fake_gpu(monkeypatch, memory_allocated)
    with pytest.warns(RuntimeWarning, match=r"memory_allocated\(\) raised RuntimeError\('CUDA driver: unknown error'\)"):
        paddle_hybrid.install_component(COMPONENT, ASYNC_ONLY)
    assert paddle.get_flags([FLAG])[FLAG] is True


def test_gpu_memory_in_use_is_warned(reinstall, monkeypatch):
    fake_gpu(monkeypatch, lambda device=None: 1 << 20)
    with pytest.warns(UserWarning, match="set after GPU memory was already allocated"):
        paddle_hybrid.install_component(COMPONENT, ASYNC_ONLY)


def test_no_gpu_device_means_nothing_to_ask(reinstall, monkeypatch):
    def memory_allocated(device=None):
        raise AssertionError("asked for GPU memory with no GPU")

    fake_gpu(monkeypatch, memory_allocated, devices=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paddle_hybrid.install_component(COMPONENT, ASYNC_ONLY)
    assert paddle.get_flags([FLAG])[FLAG] is True


def test_flag_is_set_and_restored_and_off_by_default(reinstall):
    before = paddle.get_flags([FLAG])[FLAG]
    assert paddle_hybrid.install_component(COMPONENT, PluginConfig()).status == "off"
    assert paddle.get_flags([FLAG])[FLAG] == before
    assert paddle_hybrid.install_component(COMPONENT, ASYNC_ONLY).status == "active"
    assert paddle.get_flags([FLAG])[FLAG] is True
    paddle_hybrid.uninstall_component(COMPONENT)
    assert paddle.get_flags([FLAG])[FLAG] == before
