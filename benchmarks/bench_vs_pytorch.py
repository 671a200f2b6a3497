"""examples/gpt_pp.py's GPT in Paddle (with paddle_hybrid) and in PyTorch, side by side on CPU:
1 process, tensor parallel on 2 processes, pipeline parallel (1F1B) on 2 processes, one thread
each, rounds alternated so drift of a shared machine hits every row.

* TP rows: bench_tensor_parallel.py's shape (hidden 512, 8 heads, 2 blocks, 2 x 8 sequences of
  128 per step).  Paddle: ``gpt_pp.py --mp 2`` (fleet's column/row parallel linears,
  vocab-parallel embedding and loss).  PyTorch: DTensor ``ColwiseParallel``/``RowwiseParallel``
  on qkv/proj and fc1/fc2 over a 2-rank gloo CPU mesh (embedding, LM head and loss replicated).
* PP rows: gpt_pp.py's default shape (hidden 128, 4 heads, 4 blocks, 4 x 8 sequences of 128 per
  step).  Paddle: ``gpt_pp.py --pp 2`` (fleet 1F1B).  PyTorch: ``torch.distributed.pipelining``
  ``Schedule1F1B`` over gloo, two stages of two blocks (the LM head keeps its own copy of the
  embedding matrix: pipelining has no weights tied across stages; Paddle sums the tied gradient).

Both: AdamW, global-norm clipping at 1.0, attention written as matmul + causal mask + softmax,
the same generated corpus.  Per run: tokens/s of the median step after 2 warm-up steps (a step
lasts as long as its slowest rank).  PP also shows the ratio of the measured PP2 speed-up to the
bubble-limited ideal 2 * (1 - 1/(m + 1)) for m microbatches, and tokens per CPU-second (all ranks'
CPU time, waits excluded: how much work each framework spends per token, which a shared machine
blurs far less than the wall clock).  Paddle runs through benchmarks/gpt_worker.py (the example's
model and step).  A row PyTorch cannot run on
CPU/gloo stays in the table with the error.  Writes benchmarks/results/vs_pytorch.json.

    python benchmarks/bench_vs_pytorch.py                   # 2 rounds, 8 steps per run
    python benchmarks/bench_vs_pytorch.py --rounds 1 --steps 6
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
WARM = 2
SHAPES = {
    "TP": dict(hidden=512, heads=8, layers=2, seq_len=128, micro_batch_size=8, accumulate_steps=2),
    "PP": dict(hidden=128, heads=4, layers=4, seq_len=128, micro_batch_size=8, accumulate_steps=4),
}
# (shape, layout label, processes, gpt_pp.py flags)
LAYOUTS = [("TP", "1 process", 1, ["--pp", "1", "--mp", "1"]), ("TP", "TP=2", 2, ["--pp", "1", "--mp", "2"]),
           ("PP", "1 process", 1, ["--pp", "1", "--mp", "1"]), ("PP", "PP=2 (1F1B)", 2, ["--pp", "2", "--mp", "1"])]
CORPUS_CHARS = 50000
SEED = 1234


def shape_flags(shape: dict) -> list:
    return [x for k, v in shape.items() for x in (f"--{k.replace('_', '-')}", str(v))]


# --------------------------------------------------------------------------- Paddle

def run_paddle(shape: dict, nprocs: int, flags: list, steps: int, timeout: float) -> dict:
    from paddle_hybrid.testing import launch

    args = shape_flags(shape) + flags + ["--steps", str(steps), "--corpus-chars", str(CORPUS_CHARS)]
    res = launch(os.path.join(HERE, "gpt_worker.py"), nprocs=nprocs, args=args, timeout=timeout,
                 env={"OMP_NUM_THREADS": "1"})
    return per_step([r["steps"][WARM:] for r in res], res[-1]["loss"])


def per_step(per_rank: list, loss) -> dict:
    """A step lasts as long as its slowest rank and costs the CPU time of all ranks."""
    n = min(map(len, per_rank))
    return {"step_s": [max(rank[i]["wall"] for rank in per_rank) for i in range(n)],
            "cpu_s": [sum(rank[i]["cpu"] for rank in per_rank) for i in range(n)], "loss": loss}


# --------------------------------------------------------------------------- PyTorch

def torch_model(shape: dict, vocab: int):
    """The GPT of gpt_pp.py in PyTorch: embedding + positions, pre-LN blocks (qkv columns
    head-major, so a column split gives whole heads), final LayerNorm, tied LM head."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, heads, seq = shape["hidden"], shape["heads"], shape["seq_len"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            b, t, _ = x.shape
            hd = h // heads
            # -1: this rank's heads under tensor parallelism (the local columns of qkv)
            q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, hd).permute(3, 0, 2, 1, 4)
            att = q @ k.transpose(-1, -2) / math.sqrt(hd)
            att = att + torch.full((t, t), float("-inf")).triu(1)
            y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
            x = x + self.proj(y)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, h)
            self.pos = nn.Parameter(torch.randn(seq, h) * 0.02)

        def forward(self, ids):
            return self.tok(ids) + self.pos[: ids.shape[1]]

    class Head(nn.Module):
        def __init__(self, weight=None):
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.weight = weight if weight is not None else nn.Parameter(torch.randn(vocab, h) * 0.02)

        def forward(self, x):
            return self.norm(x) @ self.weight.t()

    embed = Embed()
    blocks = nn.ModuleList(Block() for _ in range(shape["layers"]))
    # gpt_pp.py's initialisation: N(0, 0.02), output projections scaled by depth, zero biases
    nn.init.normal_(embed.tok.weight, std=0.02)
    out_std = 0.02 / math.sqrt(2 * shape["layers"])
    for block in blocks:
        for lin, std in ((block.qkv, 0.02), (block.proj, out_std), (block.fc1, 0.02), (block.fc2, out_std)):
            nn.init.normal_(lin.weight, std=std)
            nn.init.zeros_(lin.bias)
    return embed, blocks, Head


def clip_grad_norm(params, max_norm: float, group=None) -> None:
    """Global-norm clipping over plain and DTensor gradients (``clip_grad_norm_`` refuses the
    mix), summed over ``group`` (the pipeline stages) when given."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros(())
    for g in grads:
        n = torch.linalg.vector_norm(g)
        sq += (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if group is not None:
        dist.all_reduce(sq, group=group)
    coef = max_norm / (float(sq.sqrt()) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def torch_worker(argv):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    cfg = json.loads(argv[0])
    shape, layout, steps = cfg["shape"], cfg["layout"], cfg["steps"]
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from gpt_worker import load_example  # beside this script (the torch worker runs it from here)

    gpt = load_example()
    data = gpt.CharData(gpt.make_corpus(CORPUS_CHARS, SEED), shape["seq_len"], SEED)
    vocab = gpt.padded_vocab(data.vocab_size)
    embed, blocks, Head = torch_model(shape, vocab)
    micro, acc = shape["micro_batch_size"], shape["accumulate_steps"]
    loss_of = lambda logits, y: F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))  # noqa: E731

    if layout.startswith("PP"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        half = len(blocks) // 2
        part = nn.Sequential(embed, *blocks[:half]) if rank == 0 else nn.Sequential(*blocks[half:], Head())
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=acc, loss_fn=loss_of)
        model = part
    else:
        head = Head(embed.tok.weight)
        model = nn.ModuleDict({"embed": embed, "blocks": blocks, "head": head})
        if layout.startswith("TP"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world,))
            for block in blocks:
                parallelize_module(block, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                                 "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    times, last_loss = [], None
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in data.global_batch(step, micro * acc))
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        if layout.startswith("PP"):
            losses = []
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
                last_loss = float(torch.stack(losses).mean())
        else:
            total = 0.0
            for m in range(acc):
                sl = slice(m * micro, (m + 1) * micro)
                h = embed(x[sl])
                for block in blocks:
                    h = block(h)
                loss = loss_of(model["head"](h), y[sl]) / acc
                loss.backward()
                total += float(loss)
            last_loss = total
        clip_grad_norm(list(model.parameters()), 1.0, dist.group.WORLD if layout.startswith("PP") else None)
        opt.step()
        times.append({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0})
    return {"rank": rank, "steps": times[WARM:], "loss": last_loss}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(shape: dict, layout: str, nprocs: int, steps: int, timeout: float) -> dict:
    """``nprocs`` fresh processes of :func:`torch_worker` on a gloo group."""
    work = tempfile.mkdtemp(prefix="ph_vs_torch_")
    port = _free_port()
    cfg = json.dumps({"shape": shape, "layout": layout, "steps": steps})
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        out = open(os.path.join(work, f"rank{rank}.out"), "w")
        procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-worker", cfg], env=env,
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True), out))
    deadline, results, errors = time.time() + timeout, [], []
    for rank, (proc, out) in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        text = open(os.path.join(work, f"rank{rank}.out"), errors="replace").read()
        lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            results.append(json.loads(lines[-1][7:]))
        else:
            errors.append(f"rank {rank} exit {proc.returncode}: " + _last_error(text))
    if errors:
        raise RuntimeError("; ".join(errors))
    return per_step([r["steps"] for r in results], next((r["loss"] for r in results if r["loss"] is not None), None))


def _last_error(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    errs = [l for l in lines if "Error" in l or "error" in l]
    return (errs[-1] if errs else (lines[-1] if lines else "no output"))[:300]


# --------------------------------------------------------------------------- table

def ideal_pp2(m: int) -> float:
    return 2 * (1 - 1 / (m + 1))


def main():
    if sys.argv[1:2] == ["--torch-worker"]:
        print("RESULT " + json.dumps(torch_worker(sys.argv[2:])), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--only", choices=sorted(SHAPES), help="run the rows of one shape only")
    args = ap.parse_args()
    layouts = [layout for layout in LAYOUTS if args.only in (None, layout[0])]
    try:
        import torch
    except ImportError:
        print("skipped: torch not installed")
        return 0
    runs = {(fw, s, label): [] for s, label, _, _ in layouts for fw in ("Paddle", "PyTorch")}
    errors = {}
    for _ in range(args.rounds):
        for s, label, nprocs, flags in layouts:
            for fw in ("Paddle", "PyTorch"):
                key = (fw, s, label)
                if key in errors:
                    continue
                try:
                    if fw == "Paddle":
                        runs[key].append(run_paddle(SHAPES[s], nprocs, flags, args.steps, args.timeout))
                    else:
                        runs[key].append(run_torch(SHAPES[s], label, nprocs, args.steps, args.timeout))
                except Exception as exc:  # keep the row, with what went wrong
                    errors[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    rows = []
    for s, label, nprocs, _ in layouts:
        shape = SHAPES[s]
        tokens = shape["micro_batch_size"] * shape["accumulate_steps"] * shape["seq_len"]
        for fw in ("Paddle", "PyTorch"):
            key = (fw, s, label)
            row = {"framework": fw, "shape": s, "layout": label, "processes": nprocs, "error": errors.get(key)}
            if runs[key] and not row["error"]:
                per_run = [tokens / statistics.median(r["step_s"]) for r in runs[key]]
                cpu = [statistics.median(r["cpu_s"]) for r in runs[key]]
                row.update(tokens_per_s=statistics.median(per_run), min=min(per_run), max=max(per_run),
                           cpu_s_per_step=statistics.median(cpu), tokens_per_cpu_s=tokens / statistics.median(cpu),
                           final_loss=runs[key][-1]["loss"])
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["framework"] == row["framework"] and r["shape"] == row["shape"]
                    and r["processes"] == 1)
        if row.get("tokens_per_s") and base.get("tokens_per_s"):
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            if row["layout"].startswith("PP"):
                m = SHAPES["PP"]["accumulate_steps"]
                row["ideal"] = ideal_pp2(m)
                row["of_ideal"] = row["speedup"] / row["ideal"]
    print(f"gpt_pp.py GPT on CPU, OMP_NUM_THREADS=1 / torch.set_num_threads(1), {args.rounds} alternated round(s) of "
          f"{args.steps} steps (median step after {WARM}); torch {torch.__version__}")
    print(f"{'shape':5s} {'layout':12s} {'framework':9s} {'procs':>5s} {'tokens/s [min-max]':>24s} {'speed-up':>9s} "
          f"{'of PP ideal':>12s} {'tokens per CPU-s':>17s}")
    for r in rows:
        if r.get("tokens_per_s"):
            ideal = f"{r['of_ideal']:.2f} of {r['ideal']:.2f}" if "of_ideal" in r else "-"
            print(f"{r['shape']:5s} {r['layout']:12s} {r['framework']:9s} {r['processes']:5d} "
                  f"{r['tokens_per_s']:9.0f} [{r['min']:.0f}-{r['max']:.0f}]".ljust(63)
                  + f" {r.get('speedup', 1.0):8.2f}x {ideal:>12s} {r['tokens_per_cpu_s']:17.0f}")
        else:
            print(f"{r['shape']:5s} {r['layout']:12s} {r['framework']:9s} {r['processes']:5d}  does not run: {r['error']}")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "vs_pytorch.json"), "w") as f:
        json.dump({"config": vars(args), "shapes": SHAPES, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
