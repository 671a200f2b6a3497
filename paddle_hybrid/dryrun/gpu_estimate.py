"""What a rank class would hold on a GPU: an estimate, computed from the dry run's own accounting and
labelled so in the table and the JSON (``gpu_estimate``); nothing here ran on a GPU.

The CPU run holds everything in float32 and computes attention with matmuls, which save the
``[b, heads, s, s]`` scores and probabilities for backward.  A GPU job of the same script is usually
run in bfloat16 mixed precision (PaddleFormers: ``--bf16 true --amp_master_grad true``) with a fused
(flash) attention kernel.  The estimate takes the measured bytes and changes only what those change:

- parameters: float32 ones stored in bfloat16 (2 bytes an element); 16-bit ones as measured;
- gradients: float32, as measured (``amp_master_grad`` keeps float32 main gradients);
- optimizer state: as measured, plus float32 master weights of the float32 parameters this rank
  updates: half of its float32 state (Adam and AdamW keep two float32 moments an element, so the
  master weights are half of them; sharded as the moments are);
- activations saved for backward: attention's square tensors (``square:*`` in the probe's
  ``activations_by_kind``) dropped, as a flash kernel saves only its output and a per-row statistic
  (``b x heads x s`` float32: under 1/s of the scores, left out); other float32 activations halved
  (bfloat16); integer and boolean ones (masks, indices) as measured;
- the composed peak: those, with the schedule's microbatches in flight, as the CPU figure is composed;
  under fused FSDP with the largest group gathered whole (its parameters in bfloat16, its gradient
  buffer float32).

Not in it: a GPU's caching allocator (fragmentation), cuBLAS/cuDNN workspaces, NCCL's buffers, the
CUDA context (about 0.5-1 GiB a process), temporaries of the kernels' backward.  So the figure is a
floor; the headroom against ``--gpu-memory`` says how far the floor is from the device's size.
"""
from __future__ import annotations

__all__ = ["estimate", "ASSUMPTIONS"]

ASSUMPTIONS = ("GPU estimate (not measured): bfloat16 parameters and activations, float32 gradients, Adam's moments "
               "and master weights (--bf16 --amp_master_grad), flash attention (no [b, heads, s, s] tensors saved); "
               "without the allocator's fragmentation, workspaces, NCCL buffers and the CUDA context: a floor")


def _float32(by_dtype: dict) -> int:
    return int((by_dtype or {}).get("float32", 0))


def _activations(by_kind: dict) -> int:
    total = 0
    for key, size in (by_kind or {}).items():
        kind, dtype = key.split(":", 1)
        if kind == "square":
            continue
        total += size // 2 if dtype == "float32" else size
    return int(total)


def _fsdp_gathered(fsdp) -> int:
    """Fused FSDP's whole group in a backward (:func:`..report.fused_fsdp_summary`): its float32 parameters
    in bfloat16, its gradient buffer float32 as measured."""
    if not fsdp:
        return 0
    params = fsdp["gathered_parameters_bytes"]
    if all(b["dtype"] == "float32" for b in fsdp["buffers"]):
        params //= 2
    return int(params + fsdp["gathered_gradients_bytes"])


def estimate(entry: dict, gpu_memory_bytes: int) -> dict:
    """The GPU estimate of a class entry (see the module docstring); ``gpu_memory_bytes``: the device's size."""
    params = entry["parameters_by_dtype"] or {}
    fp32_params = _float32(params)
    parameters = fp32_params // 2 + sum(int(v) for k, v in params.items() if k != "float32")
    gradients = int(entry["gradients_bytes"])
    optimizer = int(entry["optimizer_bytes"]) + (_float32(entry["optimizer_by_dtype"]) // 2 if fp32_params else 0)
    per_microbatch = _activations(entry.get("activations_by_kind_per_microbatch"))
    composed = int(parameters + gradients + optimizer + per_microbatch * entry["in_flight_microbatches"]
                   + _fsdp_gathered(entry.get("fused_fsdp")))
    return {"parameters_bytes": parameters, "gradients_bytes": gradients, "optimizer_bytes": optimizer,
            "activations_bytes_per_microbatch": per_microbatch, "composed_peak_bytes": composed,
            "device_bytes": int(gpu_memory_bytes), "headroom_bytes": int(gpu_memory_bytes) - composed}
