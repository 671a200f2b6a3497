"""Measure the tables the step-time estimate prices a GPU job from, on the GPU this runs on.

Runs with PyTorch alone (no Paddle: the estimate prices kernels, and cuBLAS / flash attention / NCCL are
the libraries both frameworks call), so a user can measure their own GPU with the same script and hand
the JSON to ``python -m paddle_hybrid.plan --gpu-table FILE``.  What it measures:

* ``host``: the host's cost of issuing a kernel from PyTorch eager;
* ``gemm``: bf16 matrix products ``[m, k] x [k, n]`` on a grid of powers of two, in the three layouts a
  linear layer's forward and backward run (``nn``: x @ W; ``nt``: dY @ W^T; ``tn``: X^T @ dY);
  ``gemm_fine``: a finer grid (powers of two and 1.5 x powers of two, 512-32768) over real layers' shapes; and
  ``gemm_check``: shapes off the grid (transformer shapes), kept out of the table so the estimate's
  interpolation error is measured on shapes it was not built from;
* ``attention``: flash attention (``scaled_dot_product_attention`` on the flash backend), forward and
  forward + backward, by (batch x heads, sequence, head dim, causal); ``attention_cudnn``: the same on
  cuDNN's fused attention;
* ``membw``: a copy and an add by bytes moved (what every memory-bound op is priced by);
* ``adamw``: the fused AdamW step by parameter count (float32 master weights and moments);
* ``steps``, ``steps_llama``: whole training steps of GPT and LLaMA-style models (RMSNorm, grouped-query
  attention with rotary embeddings, SwiGLU) in bf16 with flash attention and AdamW, timed, with their peak
  memory: the end-to-end truth the estimate is checked against on this GPU;
* ``collectives``: with 2 or more visible GPUs, NCCL all-reduce / all-gather / reduce-scatter / p2p by
  bytes (one process a GPU).

Each point is the median of timed repetitions after warm-ups, with CUDA events.  A global budget
(``--budget-s``) stops the grid early and says so in the JSON rather than running past a lease.

    python3 benchmarks/bench_gpu_tables.py --out h200.json            # everything
    python3 benchmarks/bench_gpu_tables.py --only gemm,steps --out x.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

GRID_M = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
GRID_NK = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
# Shapes of real linears (tokens x hidden / tp), none on the grid.
CHECK_SHAPES = [(6144, 2304, 6144), (2048, 18432, 6144), (8192, 6144, 3072), (4096, 1536, 12288),
                (2048, 49152 // 8, 12288), (2048, 12288, 6144), (4096, 3 * 5120 // 4, 5120), (1024, 3072, 1024),
                (4096, 5632, 2048), (3072, 4096, 1024), (12288, 1280, 5120), (2048, 51200 // 8, 12288),
                (4096, 14336 // 4, 4096), (8192, 4096, 14336 // 8), (1536, 10240, 2560), (6144, 768, 3072)]
ATTN_S = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
ATTN_BH = [8, 32, 128, 512]
MEMBW_BYTES = [2 ** p for p in range(16, 33, 2)]
ADAMW_NUMEL = [2 ** p for p in range(16, 31, 2)]
# GPT shapes for whole steps: hidden, heads, layers, seq, micro batch, micro batches a step, recompute
STEP_MODELS = [
    dict(hidden=1024, heads=16, layers=24, seq=1024, mbs=4, micro=4, vocab=51200, recompute="none"),
    dict(hidden=2048, heads=16, layers=24, seq=1024, mbs=4, micro=4, vocab=51200, recompute="none"),
    dict(hidden=2048, heads=16, layers=24, seq=2048, mbs=2, micro=4, vocab=51200, recompute="full"),
    dict(hidden=4096, heads=32, layers=16, seq=2048, mbs=1, micro=8, vocab=51200, recompute="none"),
    dict(hidden=4096, heads=32, layers=16, seq=2048, mbs=2, micro=4, vocab=51200, recompute="full"),
    dict(hidden=5120, heads=40, layers=12, seq=2048, mbs=1, micro=4, vocab=51200, recompute="selective"),
    dict(hidden=1024, heads=16, layers=24, seq=1024, mbs=8, micro=2, vocab=51200, recompute="none"),
    dict(hidden=2048, heads=16, layers=12, seq=1024, mbs=1, micro=16, vocab=51200, recompute="none"),
    dict(hidden=3072, heads=24, layers=16, seq=4096, mbs=1, micro=4, vocab=51200, recompute="selective"),
]


class Budget:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds
        self.cut = []

    def over(self, what: str) -> bool:
        if time.time() > self.end:
            self.cut.append(what)
            return True
        return False


def timed(fn, warm=2, reps=None, target_s=0.01):
    """Seconds of one ``fn()``: back-to-back calls between two CUDA events, divided by their number, the median
    of three such rounds.  Back to back, as a training step queues its kernels: the CPU's launch latency is
    hidden wherever the GPU has work queued, and shows only where the kernels are shorter than a launch."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    if reps is None:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one = max(time.perf_counter() - start, 1e-6)
        reps = int(min(200, max(2, target_s / one)))
    rounds = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        rounds.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(rounds)


def gemm_point(m, n, k, layout):
    a = torch.randn((k, m) if layout == "tn" else (m, k), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, k) if layout == "nt" else (k, n), device="cuda", dtype=torch.bfloat16)
    aa = a.t() if layout == "tn" else a
    bb = b.t() if layout == "nt" else b
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: torch.matmul(aa, bb, out=out))
    return dict(m=m, n=n, k=k, layout=layout, time_s=t, tflops=2 * m * n * k / t / 1e12)


def _gemm_grid(budget, grid_m, grid_nk, part):
    rows = []
    for layout in ("nn", "nt", "tn"):
        for m in grid_m:
            for n in grid_nk:
                for k in grid_nk:
                    if budget.over(f"{part} {layout} {m}x{n}x{k}"):
                        return rows
                    rows.append(gemm_point(m, n, k, layout))
        torch.cuda.empty_cache()
    return rows


def measure_gemm(budget):
    return _gemm_grid(budget, GRID_M, GRID_NK, "gemm")


def measure_gemm_check(budget):
    rows = []
    for (m, n, k) in CHECK_SHAPES:
        for layout in ("nn", "nt", "tn"):
            if budget.over(f"gemm_check {m}x{n}x{k}"):
                return rows
            rows.append(gemm_point(m, n, k, layout))
    return rows


def measure_attention(budget, backend="flash"):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    rows = []
    for d in (64, 128):
        for causal in (True, False):
            for s in ATTN_S:
                for bh in ATTN_BH:
                    if bh * s * d * 2 * 4 > 8 * 2 ** 30:  # q, k, v, out over 8 GiB
                        continue
                    if budget.over(f"attention d{d} s{s} bh{bh}"):
                        return rows
                    q, k, v = (torch.randn(1, bh, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    with sdpa_kernel(kernel):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        grad = torch.randn_like(out)

                        def fwd():
                            with torch.no_grad():
                                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def fwd_bwd():
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.autograd.grad(o, (q, k, v), grad)

                        tf = timed(fwd)
                        tfb = timed(fwd_bwd)
                    rows.append(dict(bh=bh, s=s, d=d, causal=causal, fwd_s=tf, bwd_s=max(tfb - tf, 0.0),
                                     fwd_bwd_s=tfb, backend=backend))
                    del q, k, v, out, grad
    return rows


def measure_attention_cudnn(budget):
    """The same grid on cuDNN's fused attention (what Transformer Engine / Megatron-Core call on Hopper)."""
    return measure_attention(budget, backend="cudnn")


# A finer grid (powers of two and 1.5 x powers of two) over the shapes of real layers: the lookup takes it where a
# shape falls inside it, the coarse grid elsewhere.
FINE = sorted([2 ** p for p in range(9, 16)] + [3 * 2 ** p for p in range(8, 14)])


def measure_gemm_fine(budget):
    return _gemm_grid(budget, FINE, FINE, "gemm_fine")


def measure_membw(budget):
    rows = []
    for nbytes in MEMBW_BYTES:
        if budget.over(f"membw {nbytes}"):
            return rows
        n = nbytes // 2
        x, y = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
        z = torch.empty_like(x)
        rows.append(dict(op="copy", bytes_moved=2 * nbytes, time_s=timed(lambda: z.copy_(x))))
        rows.append(dict(op="add", bytes_moved=3 * nbytes, time_s=timed(lambda: torch.add(x, y, out=z))))
        del x, y, z
    return rows


def measure_adamw(budget):
    rows = []
    for numel in ADAMW_NUMEL:
        if budget.over(f"adamw {numel}"):
            return rows
        p = torch.nn.Parameter(torch.randn(numel, device="cuda"))
        p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        rows.append(dict(numel=numel, time_s=timed(opt.step)))
        del p, opt
    return rows


def measure_host(budget):
    """The host's cost of issuing kernels from PyTorch eager: a tiny op's time back to back (the GPU idle, so the
    time is the CPU's dispatch and launch), and a tiny linear layer's forward + backward per kernel it runs."""
    x = torch.ones(8, device="cuda")
    z = torch.empty_like(x)
    rows = [dict(op="add_tiny", kernels=1, time_s=timed(lambda: torch.add(x, x, out=z), reps=2000))]
    lin = torch.nn.Linear(8, 8, device="cuda")
    inp = torch.randn(4, 8, device="cuda", requires_grad=True)

    def fwd_bwd():
        lin(inp).sum().backward()

    # forward: addmm; sum; backward: ones/expand, mm (input grad), mm (weight grad), sum (bias grad),
    # accumulations: about 8 kernels
    rows.append(dict(op="linear_fwd_bwd_tiny", kernels=8, time_s=timed(fwd_bwd, reps=500)))
    return rows


# --------------------------------------------------------------------------- whole steps

class Block(torch.nn.Module):
    def __init__(self, h, heads, recompute):
        super().__init__()
        self.heads, self.recompute = heads, recompute
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, h)

    def body(self, x):
        y = self.ln1(x)
        if self.recompute == "selective":
            a = torch.utils.checkpoint.checkpoint(self.attention, y, use_reentrant=False)
        else:
            a = self.attention(y)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    def forward(self, x):
        if self.recompute == "full":
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class RMSNorm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaBlock(torch.nn.Module):
    """LLaMA's block: RMSNorm, grouped-query attention with rotary embeddings (flash, GQA native), SwiGLU."""

    def __init__(self, cfg):
        super().__init__()
        h, self.heads, self.kv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
        self.d, self.recompute = h // self.heads, cfg["recompute"]
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.qkv = torch.nn.Linear(h, h + 2 * self.kv * self.d, bias=False)
        self.proj = torch.nn.Linear(h, h, bias=False)
        self.gate_up = torch.nn.Linear(h, 2 * cfg["ffn"], bias=False)
        self.down = torch.nn.Linear(cfg["ffn"], h, bias=False)

    def attention(self, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def body(self, x, cos, sin):
        b, s, h = x.shape
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([h, self.kv * self.d, self.kv * self.d], dim=-1)
        q = rotate(q.view(b, s, self.heads, self.d).transpose(1, 2), cos, sin)
        k = rotate(k.view(b, s, self.kv, self.d).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        if self.recompute == "selective":
            o = torch.utils.checkpoint.checkpoint(self.attention, q, k, v, use_reentrant=False)
        else:
            o = self.attention(q, k, v)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, x, cos, sin):
        if self.recompute == "full":
            return torch.utils.checkpoint.checkpoint(self.body, x, cos, sin, use_reentrant=False)
        return self.body(x, cos, sin)


class Llama(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden"]
        self.emb, self.head = torch.nn.Embedding(cfg["vocab"], h), torch.nn.Linear(h, cfg["vocab"], bias=False)
        self.blocks = torch.nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg["layers"]))
        self.norm = RMSNorm(h)
        d = h // cfg["heads"]
        angle = torch.outer(torch.arange(cfg["seq"]).float(), 1e4 ** (-torch.arange(0, d, 2).float() / d))
        self.register_buffer("cos", torch.cat((angle, angle), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angle, angle), -1).sin(), persistent=False)

    def forward(self, tokens, labels):
        x = self.emb(tokens)
        cos, sin = self.cos.to(torch.bfloat16), self.sin.to(torch.bfloat16)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


LLAMA_STEP_MODELS = [
    dict(hidden=2048, heads=16, kv_heads=4, ffn=5632, layers=16, seq=4096, mbs=1, micro=4, vocab=32000,
         recompute="none"),
    dict(hidden=3072, heads=24, kv_heads=8, ffn=8192, layers=16, seq=4096, mbs=2, micro=4, vocab=32000,
         recompute="none"),
    dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=8, seq=8192, mbs=1, micro=2, vocab=128256,
         recompute="full"),
    dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=12, seq=4096, mbs=1, micro=4, vocab=128256,
         recompute="selective"),
    dict(hidden=4096, heads=32, kv_heads=8, ffn=11008, layers=8, seq=4096, mbs=2, micro=2, vocab=32000,
         recompute="none"),
]


class GPT(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden"]
        self.emb, self.pos = torch.nn.Embedding(cfg["vocab"], h), torch.nn.Embedding(cfg["seq"], h)
        self.blocks = torch.nn.ModuleList(Block(h, cfg["heads"], cfg["recompute"]) for _ in range(cfg["layers"]))
        self.ln = torch.nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.emb(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.emb.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def measure_step(cfg, family=None):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):  # built on the GPU: a CPU initialisation of billions of parameters takes minutes
        model = (family or GPT)(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, cfg["vocab"], (cfg["micro"], cfg["mbs"], cfg["seq"] + 1), device="cuda", generator=gen)

    def step():
        for i in range(cfg["micro"]):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens[i, :, :-1], tokens[i, :, 1:]) / cfg["micro"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    t = timed(step, warm=2, reps=2)
    params = sum(p.numel() for p in model.parameters())
    row = dict(cfg, family="llama" if family is Llama else "gpt", params=params, step_time_s=t, peak_allocated_bytes=torch.cuda.max_memory_allocated(),
               peak_reserved_bytes=torch.cuda.max_memory_reserved(), gpus=1, tp=1, pp=1, dp=1,
               precision="bf16 autocast (fp32 weights and grads), fused AdamW, flash attention (sdpa)")
    del model, opt
    return row


def measure_steps(budget):
    rows = []
    for cfg in STEP_MODELS:
        if budget.over(f"step {cfg}"):
            return rows
        try:
            rows.append(measure_step(cfg))
        except Exception as exc:  # an OOM or an unsupported kernel: recorded, not fatal
            rows.append(dict(cfg, error=f"{type(exc).__name__}: {exc}"[:300]))
    return rows


# --------------------------------------------------------------------------- collectives

def _collective_worker(rank, world, port, out_path, budget_s):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows, end = [], time.time() + budget_s
    for nbytes in [2 ** p for p in range(10, 31)]:
        if time.time() > end:
            break
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        shard = torch.empty(x.numel() // world, device="cuda", dtype=torch.bfloat16)
        full = torch.empty_like(x)
        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, x),
               "all_to_all": lambda: dist.all_to_all_single(full, x)}
        for name, fn in ops.items():
            dist.barrier()
            t = timed(fn, warm=3, reps=10)
            rows.append(dict(op=name, gpus=world, bytes=nbytes, time_s=t))
        if world == 2:
            def p2p():
                if rank == 0:
                    dist.send(x, 1)
                else:
                    dist.recv(x, 0)
            dist.barrier()
            rows.append(dict(op="p2p", gpus=world, bytes=nbytes, time_s=timed(p2p, warm=3, reps=10)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def measure_collectives(budget):
    import torch.multiprocessing as mp
    rows, world = [], torch.cuda.device_count()
    sizes = [w for w in (2, 4, 8) if w <= world]
    for w in sizes:
        if budget.over(f"collectives {w}"):
            break
        path = f"/tmp/collectives_{w}.json"
        mp.spawn(_collective_worker, args=(w, 29500 + w, path, max(budget.end - time.time(), 10) / len(sizes)),
                 nprocs=w, join=True)
        with open(path) as f:
            rows += json.load(f)
    return rows


# --------------------------------------------------------------------------- main

def measure_steps_llama(budget):
    rows = []
    for cfg in LLAMA_STEP_MODELS:
        if budget.over(f"llama step {cfg}"):
            return rows
        try:
            rows.append(measure_step(cfg, Llama))
        except Exception as exc:  # an OOM or an unsupported kernel: recorded, not fatal
            rows.append(dict(cfg, family="llama", error=f"{type(exc).__name__}: {exc}"[:300]))
    return rows


PARTS = {"host": measure_host, "gemm": measure_gemm, "gemm_check": measure_gemm_check, "attention": measure_attention,
         "membw": measure_membw, "adamw": measure_adamw, "steps": measure_steps,
         "steps_llama": measure_steps_llama, "attention_cudnn": measure_attention_cudnn,
         "gemm_fine": measure_gemm_fine,
         "collectives": measure_collectives}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts: " + ",".join(PARTS))
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop measuring after this many seconds")
    args = parser.parse_args(argv)
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}: choose from {list(PARTS)}")
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_tables: no CUDA device visible to PyTorch; run it on the GPU to be measured")
    budget = Budget(args.budget_s)
    props = torch.cuda.get_device_properties(0)
    result = dict(meta=dict(gpu=props.name, multiprocessors=props.multi_processor_count,
                            memory_bytes=props.total_memory, gpus_visible=torch.cuda.device_count(),
                            torch=torch.__version__, cuda=torch.version.cuda,
                            cudnn=torch.backends.cudnn.version(),
                            date=datetime.date.today().isoformat(), script="benchmarks/bench_gpu_tables.py"))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    for part in wanted:
        start = time.time()
        print(f"[{part}] ...", flush=True)
        result[part] = PARTS[part](budget)
        result["meta"][f"{part}_wall_s"] = round(time.time() - start, 1)
        print(f"[{part}] {len(result[part])} rows in {time.time() - start:.1f} s", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f)
    result["meta"]["cut_by_budget"] = budget.cut[:1]
    with open(args.out, "w") as f:
        json.dump(result, f)
    for part in ("steps", "steps_llama"):
        for row in result.get(part, []):
            print({k: row.get(k) for k in ("hidden", "layers", "seq", "mbs", "recompute", "step_time_s",
                                           "peak_allocated_bytes", "error")})


if __name__ == "__main__":
    main()
