"""A GPU table whose every kernel is hand-computable: GEMMs at a flat 100 TFLOP/s, flash attention at 50 TFLOP/s
forward (its backward's 2.5x FLOPs at the same rate), memory at a flat 1 TB/s, AdamW at 1e10 elements/s, measured
on "NVIDIA H200" (so pricing an H200 uses it unscaled)."""
GEMM_RATE, ATTENTION_RATE, MEMORY_RATE, ADAMW_RATE = 100e12, 50e12, 1e12, 1e10
GRID = [128, 1024, 8192, 65536]


def fake_table() -> dict:
    gemm = [dict(m=m, n=n, k=k, layout=layout, time_s=2 * m * n * k / GEMM_RATE)
            for layout in ("nn", "nt", "tn") for m in GRID for n in GRID for k in GRID]
    attention = []
    for d in (64, 128):
        for causal in (True, False):
            for bh in (8, 512):
                for s in (256, 32768):
                    flops = 4 * bh * s * s * d * (0.5 if causal else 1.0)
                    attention.append(dict(bh=bh, s=s, d=d, causal=causal, fwd_s=flops / ATTENTION_RATE,
                                          bwd_s=2.5 * flops / ATTENTION_RATE))
    membw = [dict(op="copy", bytes_moved=b, time_s=b / MEMORY_RATE) for b in (2 ** 10, 2 ** 36)]
    adamw = [dict(numel=n, time_s=n / ADAMW_RATE) for n in (2 ** 10, 2 ** 36)]
    return dict(meta=dict(gpu="NVIDIA H200"), gemm=gemm, attention=attention, membw=membw, adamw=adamw)
