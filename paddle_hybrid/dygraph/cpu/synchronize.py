"""``paddle.device.synchronize()`` on CPU.

PaddleFormers' Trainer calls ``paddle.device.synchronize()`` after every step with gradient
accumulation > 1 (and around saving); Paddle's function knows CUDA, XPU and custom places
and raises ``TypeError: device should be gpu, xpu, ...`` for the CPU place, so a CPU run stops
at its first optimizer step, also on one process.

Patch: when the place asked about (the given device, or the current one when None) is the CPU,
return at once: a CPU kernel has finished when its call returns and a gloo collective has
completed when its wait returns, so there is nothing left to wait for.  Any other place goes
to Paddle's function unchanged (so a device the build lacks still raises Paddle's error).
"""
from __future__ import annotations

import functools

__all__ = ["apply"]


def _is_cpu_place(device) -> bool:
    import paddle

    if device is None:
        place = paddle.framework._current_expected_place_()
    elif isinstance(device, str):
        return device.split(":")[0] == "cpu"
    else:
        place = device
    return isinstance(place, paddle.CPUPlace) or (hasattr(place, "is_cpu_place") and place.is_cpu_place())


def _make_synchronize(stock):
    @functools.wraps(stock)
    def synchronize(device=None):
        if _is_cpu_place(device):
            return None
        return stock(device)

    return synchronize


def apply(config, patcher) -> None:
    import paddle.device

    stock = patcher.require(paddle.device, "synchronize", "paddle.device")
    patcher.check_params(stock, ["device"], "paddle.device.synchronize")
    patcher.set(paddle.device, "synchronize", _make_synchronize(stock))
