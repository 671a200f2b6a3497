"""``Tensor.view(dtype)`` of a slice (``paddle_hybrid.dygraph.fleet_fixes.view_dtype_offset``):
Paddle reads a view to another element size from the start of the memory, not the slice's;
with the fleet fixes it is refused, naming the fix, and every view Paddle gets right is
unchanged."""
import numpy as np
import paddle
import pytest

import paddle_hybrid
from paddle_hybrid import PluginConfig
from paddle_hybrid.dygraph.fleet_fixes.view_dtype_offset import ViewOffsetError


def _slice():
    return paddle.arange(8, dtype="int32")[2:4]


def test_without_the_fix_a_slice_viewed_as_bytes_is_not_its_bytes(plugin_restored):
    paddle_hybrid.uninstall()
    paddle_hybrid.install(PluginConfig(fleet_fixes=False))
    got = _slice().view(paddle.uint8).numpy()
    assert not np.array_equal(got, np.array([2, 3], dtype="int32").view(np.uint8))  # Paddle's defect


@pytest.mark.parametrize("call", [
    lambda t: t.view(paddle.uint8),
    lambda t: t.view(dtype="int64"),
    lambda t: paddle.view(t, paddle.float16),
])
def test_a_slice_viewed_as_another_element_size_is_refused(call):
    with pytest.raises(ViewOffsetError, match=r"starts 8 bytes into its memory.*\.clone\(\) first"):
        call(_slice())


def test_what_paddle_gets_right_is_unchanged():
    whole = paddle.arange(8, dtype="int32")
    np.testing.assert_array_equal(_slice().view(paddle.float32).view(paddle.int32).numpy(), [2, 3])
    np.testing.assert_array_equal(_slice().clone().view(paddle.uint8).numpy(),
                                  np.array([2, 3], dtype="int32").view(np.uint8))
    np.testing.assert_array_equal(paddle.split(whole, [2, 2, 4])[1].view(paddle.uint8).numpy(),
                                  np.array([2, 3], dtype="int32").view(np.uint8))
    assert whole.view([2, 4]).shape == [2, 4] and whole.view(paddle.uint8).shape == [32]
    assert _slice().view([2, 1]).shape == [2, 1]
