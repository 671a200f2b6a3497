"""What a collective or a point-to-point message costs, by where its group's ranks sit.

Inside a node (NVLink / NVSwitch) a collective runs at the bus bandwidth NCCL reaches for its size:
the curve measured by nccl-tests ``all_reduce_perf`` on 8 A100s of a DGX node (vTrain's repository,
``tables/a100_allreduce_8gpu_nccl.csv``, from ``../shared/steptime/``).  Another GPU's curve is that
one scaled by the ratio of NVLink bandwidths (said in every report); sizes under the curve's 1 MiB are
priced by a latency + bytes / bandwidth line fitted to its first points.

Across nodes NCCL runs one ring per NIC; a group with ``k`` ranks on each node reaches at most ``k``
NICs' bandwidth (one direction) and never more than NVLink's curve.  The bus bandwidth convention of
nccl-tests is used throughout: an all-reduce of ``S`` bytes over ``n`` ranks takes
``2 (n - 1) / n * S / busbw``; an all-gather or reduce-scatter whose whole tensor is ``S`` bytes takes
``(n - 1) / n * S / busbw``; an all-to-all of ``S`` bytes per rank the same as an all-gather.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import os
from functools import lru_cache

__all__ = ["Placement", "place", "stride", "CommModel", "A100_CURVE"]

A100_CURVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables", "a100_allreduce_8gpu_nccl.csv")
A100_NVLINK = 300e9
NIC_EFFICIENCY = 0.92   # stated assumption: NCCL's share of an InfiniBand NIC's line rate (not measured here)
P2P_LATENCY_S = 10e-6   # stated assumption: a send/recv pair's fixed cost (NCCL p2p on NVLink / IB)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a group's ranks sit: ``size`` ranks over ``nodes`` nodes, ``per_node`` on each."""
    size: int
    nodes: int
    per_node: int


def stride(order, degrees: dict, axis: str) -> int:
    """How far apart in rank two neighbours along ``axis`` are when ranks are numbered over ``order`` (slowest
    axis first, the last varies fastest, as fleet's topology and Megatron's rank order are)."""
    step = 1
    for name in reversed(order):
        if name == axis:
            return step
        step *= degrees.get(name, 1)
    raise ValueError(f"axis {axis!r} is not in the rank order {order}")


def place(order, degrees: dict, axis: str, gpus_per_node: int) -> Placement:
    """The placement of the first group along ``axis`` (every group of a layout is placed alike when the nodes
    hold whole groups of the faster axes)."""
    size = degrees.get(axis, 1)
    if size <= 1:
        return Placement(1, 1, 1)
    step = stride(order, degrees, axis)
    ranks = [i * step for i in range(size)]
    nodes = {r // gpus_per_node for r in ranks}
    return Placement(size, len(nodes), size // len(nodes))


@lru_cache(maxsize=2)
def _curve(path: str):
    sizes, busbw = [], []
    with open(path) as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            sizes.append(float(row[0]))
            busbw.append(float(row[4]) * 1e9)
    return sizes, busbw


class CommModel:
    def __init__(self, cluster):
        self.cluster = cluster
        self.scale = cluster.gpu.nvlink_bytes_per_s / A100_NVLINK
        self.scaled = self.scale != 1.0
        sizes, busbw = _curve(A100_CURVE)
        self._sizes = [math.log(s) for s in sizes]
        self._busbw = busbw
        # latency + bytes/bandwidth through the first two points (1 and 2 MiB: time nearly flat)
        t0 = 2 * 7 / 8 * sizes[0] / busbw[0]
        t1 = 2 * 7 / 8 * sizes[3] / busbw[3]
        self._beta = (2 * 7 / 8) * (sizes[3] - sizes[0]) / max(t1 - t0, 1e-12)
        self._alpha = max(t0 - 2 * 7 / 8 * sizes[0] / self._beta, 0.0)

    # ------------------------------------------------------------------ bus bandwidth
    def _nvlink_busbw(self, nbytes: float) -> float:
        x = math.log(max(nbytes, 1.0))
        s = self._sizes
        if x <= s[0]:
            # below the curve: alpha-beta, as bus bandwidth of this size
            t = self._alpha + (2 * 7 / 8) * nbytes / self._beta
            return (2 * 7 / 8) * nbytes / t * self.scale
        if x >= s[-1]:
            return self._busbw[-1] * self.scale
        j = next(i for i, v in enumerate(s) if v >= x)
        w = (x - s[j - 1]) / (s[j] - s[j - 1])
        return (self._busbw[j - 1] * (1 - w) + self._busbw[j] * w) * self.scale

    def busbw(self, nbytes: float, where: Placement) -> float:
        bw = self._nvlink_busbw(nbytes)
        if where.nodes > 1:
            bw = min(bw, where.per_node * self.cluster.nic_bytes_per_s * NIC_EFFICIENCY)
        return bw

    # ------------------------------------------------------------------ operations
    def all_reduce(self, nbytes: float, where: Placement) -> float:
        n = where.size
        return 0.0 if n <= 1 or nbytes <= 0 else 2 * (n - 1) / n * nbytes / self.busbw(nbytes, where)

    def all_gather(self, nbytes: float, where: Placement) -> float:
        """``nbytes``: the gathered (whole) tensor."""
        n = where.size
        return 0.0 if n <= 1 or nbytes <= 0 else (n - 1) / n * nbytes / self.busbw(nbytes, where)

    reduce_scatter = all_gather
    all_to_all = all_gather

    def p2p(self, nbytes: float, same_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        bw = self.cluster.gpu.nvlink_bytes_per_s * 0.8 if same_node else self.cluster.nic_bytes_per_s * NIC_EFFICIENCY
        return P2P_LATENCY_S + nbytes / bw
