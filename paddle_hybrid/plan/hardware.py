"""The GPUs and clusters a step is priced on: each figure with where it comes from.

A ``GPU`` holds what the pricing needs beyond its measured tables: dense bf16 peak (to scale a table
measured on another GPU and to state MFU), HBM bandwidth (to scale memory-bound ops), memory size,
NVLink bandwidth (one direction) and the GPUs of a node.  A ``Cluster`` adds the network between
nodes (GB/s per GPU, one direction) and what the user overrides (``--gpus-per-node``,
``--inter-node-gbps``, ``--gpu-memory``).
"""
from __future__ import annotations

import dataclasses

__all__ = ["GPU", "Cluster", "GPUS", "gpu_named", "cluster"]

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_flops: float      # dense, per second
    hbm_bytes_per_s: float
    memory_bytes: int           # what a process can allocate at most
    nvlink_bytes_per_s: float   # one direction, per GPU
    gpus_per_node: int
    nic_bytes_per_s: float      # one direction, per GPU (one NIC a GPU in these systems)
    source: str


# Datasheet figures (dense, SXM parts); the shared notes (../shared/steptime/README.md) list the same and
# warn against A100's sparse 624.  Memory: what the CUDA driver reports (H200: 143771 MiB seen on the
# project's lent H200; A100-80GB and H100-80GB: 81920 / 81559 MiB).
GPUS = {
    "a100-80g": GPU("A100-80GB SXM", 312e12, 2.039e12, 81920 * 2 ** 20, 300e9, 8, 25e9,
                    "NVIDIA A100 datasheet (312 TFLOP/s dense bf16, 2.039 TB/s, NVLink 600 GB/s both directions); "
                    "DGX A100: 8 HDR InfiniBand 200 Gb/s NICs a node"),
    "h100": GPU("H100-80GB SXM", 989e12, 3.35e12, 81559 * 2 ** 20, 450e9, 8, 50e9,
                "NVIDIA H100 datasheet (989 TFLOP/s dense bf16, 3.35 TB/s, NVLink 900 GB/s both directions); "
                "DGX H100: 8 NDR InfiniBand 400 Gb/s NICs a node"),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 143771 * 2 ** 20, 450e9, 8, 50e9,
                "NVIDIA H200 datasheet (989 TFLOP/s dense bf16, 4.8 TB/s, NVLink 900 GB/s both directions); "
                "HGX H200 nodes: 8 NDR 400 Gb/s NICs"),
}


def gpu_named(name: str) -> GPU:
    key = name.lower().replace("_", "-")
    key = {"a100": "a100-80g", "a100-80gb": "a100-80g", "h100-80g": "h100", "h100-sxm": "h100",
           "h200-sxm": "h200"}.get(key, key)
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r}: no tables for this GPU; known: {', '.join(GPUS)} (measure yours with "
                         "benchmarks/bench_gpu_tables.py and pass --gpu-table FILE with the nearest --gpu)")
    return GPUS[key]


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int
    nic_bytes_per_s: float
    memory_bytes: int

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


def cluster(gpu: GPU, gpus: int, gpus_per_node=None, inter_node_gbps=None, gpu_memory_gb=None) -> Cluster:
    """The cluster of ``gpus`` GPUs; ``inter_node_gbps`` in Gbit/s per GPU, ``gpu_memory_gb`` in GB (1e9)."""
    per_node = gpus_per_node or gpu.gpus_per_node
    if gpus < 1 or per_node < 1:
        raise ValueError(f"--gpus {gpus} and --gpus-per-node {per_node} must be at least 1")
    nic = gpu.nic_bytes_per_s if inter_node_gbps is None else inter_node_gbps * 1e9 / 8
    memory = gpu.memory_bytes if gpu_memory_gb is None else int(gpu_memory_gb * 1e9)
    return Cluster(gpu, gpus, min(per_node, gpus), nic, memory)
