"""Device: ``PipelineLayer`` (and recompute_hybrid's backward) read ``ParallelEnv().device_id``,
whose ``_device_id`` Paddle sets only for CUDA/XPU/custom devices (``AttributeError: ...
'_device_id'`` on CPU).

Patch: the ``ParallelEnv.device_id`` property answers 0 (the one host) when the environment has
no ``_device_id`` and the run is on the CPU; otherwise it is Paddle's property.  A class-level
``_device_id = 0`` default would be simpler, but it would answer for every instance on every
device; the property asks where the run is at each read, so a run on an accelerator keeps
Paddle's answer, or Paddle's error.
"""
from __future__ import annotations

from ...registry.device import running_on_cpu

__all__ = ["apply"]


def _make_device_id(stock_property):
    def device_id(self):
        if "_device_id" not in vars(self) and running_on_cpu():
            return 0
        return stock_property.fget(self)

    device_id.__doc__ = stock_property.__doc__
    return property(device_id)


def apply(config, patcher) -> None:
    import paddle.distributed.parallel as parallel

    from ...registry.patching import PatchSignatureError

    env_cls = parallel.ParallelEnv
    stock = vars(env_cls).get("device_id")
    if not isinstance(stock, property) or stock.fget is None:
        raise PatchSignatureError(f"{patcher.component}: ParallelEnv.device_id is not a property; unexpected "
                                  f"Paddle. Set {patcher.off_switch} to run without the CPU/gloo patches.")
    patcher.set(env_cls, "device_id", _make_device_id(stock))
