"""GPUs and clusters the planner knows by name.

Peak numbers are the vendors' dense 16-bit tensor-core figures (no 2:4 sparsity),
which is what the MFU literature divides by (Korthikanti et al. use 312 TFLOP/s
for the A100). Memory is what ``nvidia-smi`` reports as total, in bytes, so a
"80 GB" part is 80 GiB (A100) or 81559 MiB (H100/H800).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator model."""

    name: str
    memory_bytes: float
    """Device memory as ``nvidia-smi`` reports it."""
    peak_flops: float
    """Dense 16-bit (BF16/FP16) tensor-core FLOP/s."""
    memory_bandwidth: float
    """HBM bandwidth in bytes/s."""
    nvlink_bandwidth: float
    """Intra-node bytes/s per GPU, one direction (NVLink)."""
    network_bandwidth: float
    """Inter-node bytes/s per GPU, one direction (one InfiniBand HCA per GPU)."""

    def __post_init__(self):
        for field_name in ("memory_bytes", "peak_flops", "memory_bandwidth", "nvlink_bandwidth", "network_bandwidth"):
            value = getattr(self, field_name)
            if value <= 0:
                raise ValueError(f"GPU {self.name!r}: {field_name}={value} must be positive")


GPU_PRESETS: dict[str, GPU] = {
    # Selene-style DGX A100: NVLink 3 (600 GB/s both ways), one 200 Gb/s HDR HCA per GPU.
    "A100-80G": GPU(name="A100-80G", memory_bytes=81920 * MIB, peak_flops=312e12, memory_bandwidth=2.039e12,
                    nvlink_bandwidth=300e9, network_bandwidth=25e9),
    "A100-40G": GPU(name="A100-40G", memory_bytes=40960 * MIB, peak_flops=312e12, memory_bandwidth=1.555e12,
                    nvlink_bandwidth=300e9, network_bandwidth=25e9),
    # H100/H200 SXM: NVLink 4 (900 GB/s both ways), one 400 Gb/s NDR HCA per GPU.
    "H100": GPU(name="H100", memory_bytes=81559 * MIB, peak_flops=989.4e12, memory_bandwidth=3.35e12,
                nvlink_bandwidth=450e9, network_bandwidth=50e9),
    # H800: the export H100 SXM; same HBM and tensor cores, NVLink cut to 400 GB/s both ways.
    "H800": GPU(name="H800", memory_bytes=81559 * MIB, peak_flops=989.4e12, memory_bandwidth=3.35e12,
                nvlink_bandwidth=200e9, network_bandwidth=50e9),
    "H200": GPU(name="H200", memory_bytes=143771 * MIB, peak_flops=989.4e12, memory_bandwidth=4.8e12,
                nvlink_bandwidth=450e9, network_bandwidth=50e9),
}


def get_gpu(name: str) -> GPU:
    """Look a GPU preset up by name (case-insensitive)."""
    by_lower = {key.lower(): gpu for key, gpu in GPU_PRESETS.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    raise ValueError(
        f"unknown GPU {name!r}: use one of {sorted(GPU_PRESETS)}, "
        "or describe it with --gpu-memory-gib and --peak-tflops"
    )


def custom_gpu(*, base: GPU | None, memory_gib: float | None, peak_tflops: float | None) -> GPU:
    """A preset with its memory and/or peak overridden, or a GPU described by both.

    A GPU described from scratch takes the A100's memory and link bandwidths."""
    if base is None and (memory_gib is None or peak_tflops is None):
        raise ValueError(
            "a GPU needs a name (--gpu A100-80G) or both --gpu-memory-gib and --peak-tflops"
        )
    if memory_gib is None and peak_tflops is None:
        return base
    start = base or GPU_PRESETS["A100-80G"]
    return replace(
        start,
        name=f"{base.name}*" if base else "custom",
        memory_bytes=memory_gib * GIB if memory_gib is not None else start.memory_bytes,
        peak_flops=peak_tflops * 1e12 if peak_tflops is not None else start.peak_flops,
    )


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous cluster: ``num_gpus`` GPUs, ``gpus_per_node`` to a node."""

    gpu: GPU
    num_gpus: int
    gpus_per_node: int = 8
    """Tensor parallelism stays inside a node (it needs NVLink bandwidth)."""

    def __post_init__(self):
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"num_gpus={self.num_gpus} and gpus_per_node={self.gpus_per_node} must be at least 1"
            )
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"num_gpus={self.num_gpus} is not a whole number of nodes of "
                f"gpus_per_node={self.gpus_per_node}; use a multiple of {self.gpus_per_node}"
            )
