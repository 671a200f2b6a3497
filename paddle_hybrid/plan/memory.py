"""What one GPU of a layout holds at its peak: parameters, gradients and optimizer state (mixed precision,
sharded as the layout's sharding stage says), the activations of the microbatches the schedule keeps in
flight, the largest backward temporary; then the caching allocator's fragmentation (measured) and the CUDA
context (assumed).

Activations saved per layer and microbatch follow Korthikanti et al. 2022 (section 4), generalised to
grouped-query attention, a gated MLP and flash attention; for GPT without those they are exactly the
paper's ``sbh (34 + 5 a s / h)`` (no parallelism), ``sbh (10 + 24 / t + 5 a s / (h t))`` (tensor parallel),
``sbh (34 + 5 a s / h) / t`` (with sequence parallelism), ``34 sbh / t`` with selective recompute and
``2 sbh`` (``/ t`` with sequence parallelism) with full recompute: the test suite checks these.
"""
from __future__ import annotations

__all__ = ["layer_activation_bytes", "state_bytes_per_param", "device_bytes", "FRAGMENTATION", "CONTEXT_BYTES"]

BF16 = 2
# Measured: what a caching allocator holds over what is allocated at the peak, PyTorch's on the project's 14 H200
# training steps (benchmarks/bench_gpu_tables.py: peak reserved / peak allocated, 1.017-1.098, mean 1.05).
FRAGMENTATION = 1.05
# Stated assumption, not measured here: the CUDA context, cuBLAS workspaces and NCCL's buffers of a training
# process, outside the allocator (PyTorch and Paddle report 0.5-1 GiB of context a process).
CONTEXT_BYTES = int(1.0 * 2 ** 30)


def device_bytes(allocated: int) -> int:
    """What a GPU holds when ``allocated`` bytes are allocated at the peak: the allocator's share, the context."""
    return int(allocated * FRAGMENTATION) + CONTEXT_BYTES


def layer_activation_bytes(model, mbs: int, tp: int, sp: bool, recompute: str) -> int:
    """Bytes one layer saves for backward for one microbatch on one tensor-parallel rank."""
    s, b, h, a = model.seq, mbs, model.hidden, model.heads
    sbh = s * b * h
    kv_ratio = model.kv_heads / model.heads
    split = tp if sp else 1               # what lives outside the tensor-parallel regions
    if recompute == "full":
        return int(BF16 * sbh / split)
    mask = 1 if model.dropout else 0
    outside = (2 + 2 + mask + 2 + 2 + mask) * sbh / split          # norm1 in, qkv in, mask, norm2 in, fc1 in, mask
    qkv = BF16 * sbh * (1 + 2 * kv_ratio) / tp                       # Q, K, V
    proj_in = BF16 * sbh / tp                                        # attention output (flash saves it too)
    ffn_ratio = model.ffn / h
    mlp = BF16 * sbh * ffn_ratio * ((2 if model.gated else 1) + 1) / tp  # activation input(s) and fc2 input
    if model.attention == "flash":
        core = 4 * b * a * s / tp                                    # the per-row log-sum-exp, float32
    elif recompute == "sel":
        core = 0
    else:
        core = (2 + mask + 2 * mask) * a * s * s * b / tp if model.dropout else 2 * a * s * s * b / tp
    return int(outside + qkv + proj_in + mlp + core)


def state_bytes_per_param(stage: int, sharding: int) -> dict:
    """Bytes a parameter costs a rank, by kind: bf16 weights, float32 main gradients, float32 master weights and
    Adam's two moments; sharding stage 1 splits the optimizer's 12, stage 2 also the gradients, stage 3 also
    the weights."""
    n = max(sharding, 1)
    return {"parameters": BF16 / (n if stage >= 3 else 1),
            "gradients": 4 / (n if stage >= 2 else 1),
            "optimizer": 12 / n}
