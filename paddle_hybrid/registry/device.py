"""Where a run is: the facts the device rule is decided on.

The device rule (README, "The device rule"): a path is on by default only on a device where it has
executed and been tested.  Two different questions are asked, and each has one answer here:

* **What can this Paddle build run on?** (:func:`accelerator_build`) decides what a component
  installs under its ``auto`` setting: the CPU/gloo emulations install only on a build with no
  accelerator; paths never run on an accelerator wait for an opt-in on a build that has one.
* **Where is this call running?** (:func:`is_gloo`, :func:`on_cpu`, :func:`running_on_cpu`)
  decides, per call, whether a replacement of a Paddle function does its CPU/gloo work or hands
  the call to Paddle's original, and which clock or backend a feature uses.  How Paddle was
  compiled does not answer that: a CUDA build can run on CPU.
"""
from __future__ import annotations

__all__ = ["accelerator_build", "cuda_build", "xpu_build", "cuda_devices", "is_gloo", "on_cpu", "running_on_cpu",
           "custom_device_types_with_cpu"]


def accelerator_build() -> str | None:
    """The accelerator this Paddle build can run on, or None for a CPU-only build.

    ``"cuda"`` (also ROCm builds, which Paddle reports as compiled with CUDA), ``"xpu"``, or
    ``"custom:<type>[,<type>...]"`` for plugged-in custom devices (NPU, MLU, ...).
    """
    if cuda_build():
        return "cuda"
    if xpu_build():
        return "xpu"
    custom = _custom_device_types()
    if custom:
        return "custom:" + ",".join(sorted(custom))
    return None


def cuda_build() -> bool:
    """This Paddle build was compiled with CUDA (ROCm builds say so too): what a CUDA-only API
    (CUDA graphs, NCCL, the CUDA allocator) needs before it can be asked anything else."""
    import paddle

    return bool(paddle.is_compiled_with_cuda())


def xpu_build() -> bool:
    """This Paddle build was compiled with XPU support: what an XPU-only setting of Paddle's
    (``XPU_CDNN_CLUSTER_PARALLEL``) needs before it means anything."""
    import paddle

    return bool(paddle.is_compiled_with_xpu())


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 on a build without CUDA)."""
    import paddle

    return paddle.device.cuda.device_count() if cuda_build() else 0


def _custom_device_types() -> list:
    import paddle

    getter = getattr(paddle.device, "get_all_custom_device_type", None)
    if getter is None:
        return []
    return list(getter() or [])


def is_gloo(group) -> bool:
    """True when ``group`` (a ``paddle.distributed`` group, or None for the global one) is backed
    by gloo, the only backend the CPU emulations were written and run for."""
    if group is None:
        import paddle.distributed as dist

        group = dist.collective._get_global_group()
    try:
        process_group = group.process_group
    except AttributeError:
        return False
    # The dry run's fake world (paddle_hybrid.gloo.fake_world) stands for gloo: every feature takes gloo's path.
    return type(process_group).__name__ in ("ProcessGroupGloo", "FakeProcessGroup")


def on_cpu(tensor) -> bool:
    """True when ``tensor`` lives in host memory."""
    try:
        return bool(tensor.place.is_cpu_place())
    except AttributeError:
        return False


def running_on_cpu() -> bool:
    """True when new tensors are placed on the CPU (``paddle.get_device()`` is ``"cpu"``)."""
    import paddle

    return paddle.get_device().split(":")[0] == "cpu"


def custom_device_types_with_cpu() -> list:
    """The custom device types Paddle lists (asked at each call), and the CPU: what a device
    answer (``Patcher.answer``) gives a Paddle check that accepts only GPU, XPU or a custom
    device, on a CPU run."""
    import paddle

    return [*list(paddle.device.get_all_custom_device_type() or []), "cpu"]
