"""Rates of the devices the planner knows: compute peak, memory, and the links between ranks.

GPU rows are the vendors' published dense peaks (SXM parts) and typical links (NVLink within a
node, one 400 Gb/s InfiniBand NIC per GPU across nodes for H100/H200, 200 Gb/s for A100). Reaching
the peak is not free: `efficiency` is the fraction of it a well-tuned LLM step sustains (MFU ~0.4-0.55
on these parts in public reports), and `link_efficiency` the fraction of link bandwidth that ring
collectives reach. The `cpu` row was measured on the 2-core machine this project is developed on
(fp32 matmul throughput with one thread per rank, gloo over loopback); its efficiency is 1 because
the rate is already what a step gets. Override any row from Python (`replace(DEVICES["h100"], ...)`)
or the peak from the command line (`trainer.peak_tflops`, `cluster.gpu_memory_gib`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # per rank
    tflops_bf16: float  # dense peak for 16-bit matmuls
    tflops_fp32: float  # dense peak for fp32 matmuls (no TF32)
    intra_node_gbps: float  # GB/s per rank, one direction, within a node
    inter_node_gbps: float  # GB/s per rank, one direction, across nodes
    efficiency: float  # sustained fraction of the compute peak
    link_efficiency: float  # sustained fraction of the link bandwidth in ring collectives
    host_memory_gib: float  # per node: where offloaded shards and optimizer state live
    shm_gbps: float = 0.0  # GB/s per rank of our engine's shared-memory all-gathers and reduce-scatters (CPU)

    def tflops(self, dtype: str) -> float:
        return self.tflops_fp32 if dtype == "float32" else self.tflops_bf16


DEVICES: dict[str, Device] = {
    "h100": Device("H100 80GB SXM", 80.0, 989.0, 67.0, 450.0, 50.0, 0.5, 0.8, 2048.0),
    "h200": Device("H200 141GB SXM", 141.0, 989.0, 67.0, 450.0, 50.0, 0.5, 0.8, 2048.0),
    # H800: the H100's compute and memory with NVLink cut to 400 GB/s (200 per direction); DeepSeek-V3
    # trained on 2048 of them, 8 per node, one 400 Gb/s InfiniBand NIC per GPU (arXiv 2412.19437)
    "h800": Device("H800 80GB SXM", 80.0, 989.0, 67.0, 200.0, 50.0, 0.5, 0.8, 2048.0),
    "a100": Device("A100 80GB SXM", 80.0, 312.0, 19.5, 300.0, 25.0, 0.5, 0.8, 1024.0),
    # Measured here (2 cores shared with other jobs, load ~15): a 1024^3 matmul on one thread runs
    # at 20 GFLOP/s in fp32 and 130 GFLOP/s in bf16; we plan with 40 GFLOP/s fp32 for a quiet
    # machine. Links: gloo over loopback, ~1 GB/s; our engine's all-gathers and reduce-scatters
    # between the ranks of one host through shared memory, 2.3-2.6 GB/s (bench/transport.py:
    # 4M-element fp32 shards, 2 ranks). Memory: the machine's 24 GiB, shared by its ranks (host
    # memory is the same memory).
    "cpu": Device("CPU (this machine, measured)", 24.0, 0.13, 0.04, 1.0, 1.0, 1.0, 1.0, 24.0, shm_gbps=2.4),
}

GPU_DEFAULT = "h100"


def device_for(gpu_type: str, gpus_per_node: int) -> str:
    """The table row for `cluster.gpu_type` ("auto": h100 for a GPU job, cpu otherwise)."""
    if gpu_type == "auto":
        return GPU_DEFAULT if gpus_per_node > 0 else "cpu"
    return gpu_type
