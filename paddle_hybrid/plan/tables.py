"""Kernel times measured on a GPU, looked up at any shape: GEMM, flash attention, memory-bound ops,
the fused AdamW step.

A table is the JSON ``benchmarks/bench_gpu_tables.py`` writes on the GPU it measures.  The project
ships one measured on an H200 (``tables/h200_measured.json``, its provenance in its ``meta``); a
user passes their own with ``--gpu-table``.  Another GPU is priced from a table of a different one
by scaling (said in every report): the part of a kernel's time above the table's launch floor is
multiplied by the ratio of dense peaks (GEMM, attention) or of HBM bandwidths (memory-bound ops,
AdamW); the floor is kept, as launch latency does not follow the peak.

Lookups interpolate throughput (FLOP/s or bytes/s) linearly in the logarithms of the shape, and
clamp the shape to the grid for the throughput (a larger kernel runs at the largest measured one's
rate; a smaller one never faster than the smallest measured time).
"""
from __future__ import annotations

import bisect
import json
import math
import os
from functools import lru_cache

__all__ = ["KernelTables", "load", "DEFAULT_TABLE"]

DEFAULT_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables", "h200_measured.json")
_LAYOUTS = ("nn", "nt", "tn")


def _bracket(grid, x):
    """(i, j, w): x between grid[i] and grid[j] at weight w (log space), clamped to the ends."""
    lx = math.log(x)
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 1, len(grid) - 1, 0.0
    j = bisect.bisect_left(grid, x)
    i = j - 1
    w = (lx - math.log(grid[i])) / (math.log(grid[j]) - math.log(grid[i]))
    return i, j, w


class _Grid:
    """log(value) on a rectangular grid of any dimension, interpolated multilinearly in log(shape)."""

    def __init__(self, axes, values):
        self.axes = axes            # list of sorted grids
        self.values = values        # dict: tuple of grid values -> log(value)

    def __call__(self, *point):
        corners = [_bracket(axis, x) for axis, x in zip(self.axes, point)]
        total = 0.0
        for mask in range(2 ** len(corners)):
            weight, key = 1.0, []
            for bit, (i, j, w) in enumerate(corners):
                pick = (mask >> bit) & 1
                weight *= w if pick else (1.0 - w)
                key.append(self.axes[bit][j if pick else i])
            if weight:
                total += weight * self.values[tuple(key)]
        return math.exp(total)


class KernelTables:
    """Times (seconds) of kernels on ``gpu`` from a table measured on ``table_gpu_name``."""

    def __init__(self, data: dict, compute_scale: float = 1.0, memory_scale: float = 1.0, scaled_from=None):
        self.meta = data["meta"]
        self.scaled_from = scaled_from
        self.compute_scale, self.memory_scale = compute_scale, memory_scale
        self._gemm, self._gemm_fine = {}, {}
        self._floor = min(r["time_s"] for r in data["gemm"])
        for layout in _LAYOUTS:
            grid = self._gemm_grid([r for r in data["gemm"] if r["layout"] == layout])
            if grid is None:
                raise ValueError(f"GPU table {self.meta.get('gpu')}: the '{layout}' GEMM grid is missing or has "
                                 "holes (was the benchmark cut by its budget? see meta.cut_by_budget)")
            self._gemm[layout] = grid
            fine = self._gemm_grid([r for r in data.get("gemm_fine", []) if r["layout"] == layout])
            if fine is not None:  # an incomplete fine grid is left unused: the coarse one prices everything
                self._gemm_fine[layout] = fine
        self._attention_grid = {}
        for row in data.get("attention", []) + data.get("attention_cudnn", []):
            self._attention_grid.setdefault((row.get("backend", "flash"), row["d"], bool(row["causal"])),
                                            []).append(row)
        for key, rows in list(self._attention_grid.items()):
            self._attention_grid[key] = self._attention_rates(key[1:], rows)
            if self._attention_grid[key] is None:
                del self._attention_grid[key]
        membw = [r for r in data.get("membw", []) if r["op"] == "copy"]
        self._membw = _Grid([sorted(r["bytes_moved"] for r in membw)],
                            {(r["bytes_moved"],): math.log(r["bytes_moved"] / r["time_s"]) for r in membw}) if membw \
            else None
        self._membw_floor = min((r["time_s"] for r in membw), default=0.0)
        adam = data.get("adamw", [])
        self._adamw = _Grid([sorted(r["numel"] for r in adam)],
                            {(r["numel"],): math.log(r["numel"] / r["time_s"]) for r in adam}) if adam else None

    @staticmethod
    def _gemm_grid(rows):
        """The throughput grid of one layout's rows, or None when they do not fill a rectangular grid."""
        if not rows:
            return None
        axes = [sorted({r[k] for r in rows}) for k in ("m", "n", "k")]
        values = {(r["m"], r["n"], r["k"]): math.log(2 * r["m"] * r["n"] * r["k"] / r["time_s"]) for r in rows}
        if len(axes[0]) * len(axes[1]) * len(axes[2]) != len(values):
            return None
        return _Grid(axes, values)

    @staticmethod
    def _attention_rates(key, rows):
        """(forward, backward) throughput grids over (bh, s) of one (head dim, causal), or None with holes."""
        axes = [sorted({r["bh"] for r in rows}), sorted({r["s"] for r in rows})]
        flops = lambda r: 4 * r["bh"] * r["s"] ** 2 * key[0] * (0.5 if key[1] else 1.0)  # noqa: E731
        have = {(r["bh"], r["s"]): r for r in rows}
        # A point the benchmark skipped for memory (a large bh at a long sequence) takes the rate of the largest
        # bh measured at that sequence: the kernel is saturated there already.
        fwd, bwd = {}, {}
        for bh in axes[0]:
            for s in axes[1]:
                row = have.get((bh, s)) or next((have[(b2, s)] for b2 in reversed(axes[0]) if (b2, s) in have),
                                                None)
                if row is None:
                    continue
                fwd[(bh, s)] = math.log(flops(row) / row["fwd_s"])
                bwd[(bh, s)] = math.log(2.5 * flops(row) / max(row["bwd_s"], 1e-9))
        if len(fwd) != len(axes[0]) * len(axes[1]):
            return None
        return _Grid(axes, fwd), _Grid(axes, bwd)

    def has_attention(self, backend: str) -> bool:
        return any(key[0] == backend for key in self._attention_grid)

    # ------------------------------------------------------------------ scaling
    def _compute(self, seconds: float, floor: float) -> float:
        return max(seconds, floor) if self.compute_scale == 1.0 else floor + max(seconds - floor, 0.0) * self.compute_scale

    def _memory(self, seconds: float, floor: float) -> float:
        return max(seconds, floor) if self.memory_scale == 1.0 else floor + max(seconds - floor, 0.0) * self.memory_scale

    # ------------------------------------------------------------------ kernels
    def gemm(self, m: int, n: int, k: int, layout: str = "nn") -> float:
        """Seconds of a bf16 ``[m, k] x [k, n]`` product (``nt``: the second operand transposed, ``tn``: the first)."""
        if min(m, n, k) <= 0:
            return 0.0
        fine = self._gemm_fine.get(layout)
        inside = fine is not None and all(axis[0] <= x <= axis[-1] for axis, x in zip(fine.axes, (m, n, k)))
        rate = (fine if inside else self._gemm[layout])(m, n, k)
        return self._compute(2.0 * m * n * k / rate, self._floor)

    def attention(self, bh: int, s: int, d: int, causal: bool = True, backend: str = "flash") -> tuple:
        """(forward, backward) seconds of fused attention (``flash``: FlashAttention-2 as PyTorch's flash backend
        runs it; ``cudnn``: cuDNN's fused attention) over ``bh`` (batch x heads) sequences of ``s``; the nearest
        measured head dimension's rate."""
        d_key = min((dd for b, dd, c in self._attention_grid if c == causal and b == backend),
                    key=lambda dd: abs(dd - d), default=None)
        if d_key is None:
            raise ValueError(f"the GPU table has no '{backend}' attention rows: measure them (bench_gpu_tables.py "
                             "--only attention,attention_cudnn)")
        fwd_rate, bwd_rate = self._attention_grid[(backend, d_key, causal)]
        flops = 4.0 * bh * s * s * d * (0.5 if causal else 1.0)
        return (self._compute(flops / fwd_rate(bh, s), self._floor),
                self._compute(2.5 * flops / bwd_rate(bh, s), self._floor))

    def memory_bound(self, bytes_moved: float) -> float:
        """Seconds of a memory-bound kernel that reads and writes ``bytes_moved`` bytes in all."""
        if bytes_moved <= 0:
            return 0.0
        if self._membw is None:
            raise ValueError("the GPU table has no memory-bandwidth rows (bench_gpu_tables.py --only membw)")
        return self._memory(bytes_moved / self._membw(bytes_moved), self._membw_floor)

    def adamw(self, numel: int) -> float:
        """Seconds of a fused AdamW step over ``numel`` float32 parameters (master weights and moments)."""
        if numel <= 0:
            return 0.0
        if self._adamw is None:
            # 4 float32 tensors read (param, grad, m, v), 3 written: 28 bytes an element
            return self.memory_bound(28.0 * numel)
        return self._memory(numel / self._adamw(numel), self._membw_floor)


@lru_cache(maxsize=8)
def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@lru_cache(maxsize=16)
def load(gpu, path: str | None = None) -> KernelTables:
    """The tables to price ``gpu`` (a :class:`~.hardware.GPU`) with: ``path`` (default: the shipped H200
    table), scaled when the table was measured on another GPU."""
    from .hardware import GPUS

    path = path or DEFAULT_TABLE
    if not os.path.exists(path):
        raise FileNotFoundError(f"GPU table {path} not found: measure one with benchmarks/bench_gpu_tables.py")
    data = _read(os.path.abspath(path))
    measured_name = data["meta"].get("gpu", "")
    measured = next((g for g in GPUS.values() if g.name.split()[0].split("-")[0].lower() in measured_name.lower()),
                    None)
    if measured is None:
        raise ValueError(f"GPU table {path}: measured on {measured_name!r}, which no preset names; its peak and "
                         "bandwidth are needed to scale it")
    if measured.name == gpu.name:
        return KernelTables(data)
    return KernelTables(data, compute_scale=measured.peak_bf16_flops / gpu.peak_bf16_flops,
                        memory_scale=measured.hbm_bytes_per_s / gpu.hbm_bytes_per_s, scaled_from=measured_name)
