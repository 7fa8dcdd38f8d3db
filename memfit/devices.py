"""Devices memfit can plan for without having one: memory, dense throughput and bandwidth.

Figures are the vendors' published peaks (dense, without sparsity), each with its source. Op
times in estimate mode are ``max(FLOPs / peak, bytes moved / bandwidth) / EFFICIENCY``: a
roofline, so an estimated slowdown ranks plans well but is not a stopwatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.errors import MemfitError

if TYPE_CHECKING:
    import torch

GiB = 2**30
EFFICIENCY = 0.6  # share of the peak that real kernels of a training step reach (a common rule of thumb)
CUDA_CONTEXT_BYTES = GiB // 2  # CUDA context and cuBLAS/cuDNN workspaces, not counted by the allocator


@dataclass(frozen=True, slots=True)
class Device:
    name: str  # key, as --target takes it
    title: str  # the product, for messages and for matching torch.cuda.get_device_name
    memory_bytes: int
    tflops: dict[str, float]  # dense, per dtype name: float32 (without TF32), tf32, bfloat16, float16
    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    cuda: bool = True  # allocations are rounded as the CUDA caching allocator rounds them

    @property
    def usable_bytes(self) -> int:
        """What a training step can use: the memory less the CUDA context."""
        return self.memory_bytes - (CUDA_CONTEXT_BYTES if self.cuda else 0)

    def flops_per_s(self, dtype: torch.dtype) -> float:
        key = str(dtype).removeprefix("torch.")  # no torch import: the CLI reads this table before loading torch
        return self.tflops.get(key if key in ("bfloat16", "float16") else "float32", self.tflops["float32"]) * 1e12

    def seconds(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        return max(flops / self.flops_per_s(dtype), nbytes / (self.bandwidth_gbs * 1e9)) / EFFICIENCY


def _gb(n: float) -> int:
    return int(n * GiB)


def _mib(n: int) -> int:
    """A card's memory as the driver reports it (``torch.cuda.mem_get_info``'s total,
    nvidia-smi's "MiB"), where that is less than the marketed figure."""
    return n * 2**20


# NVIDIA A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
# nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS
_A100 = {"float32": 19.5, "tf32": 156, "bfloat16": 312, "float16": 312}
# NVIDIA H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet),
# SXM: FP32 67, TF32 494.5, BF16/FP16 989.5 TFLOPS dense (the sheet's 1,979 is with sparsity)
_HOPPER = {"float32": 67, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5}


DEVICES: dict[str, Device] = {d.name: d for d in (
    # A100 (datasheet above): 40GB at 1,555 GB/s, 80GB SXM at 2,039 GB/s
    Device("a100-40gb", "NVIDIA A100-SXM4-40GB", _gb(40), _A100, 1555),
    Device("a100-80gb", "NVIDIA A100-SXM4-80GB", _gb(80), _A100, 2039),
    # H100 SXM (datasheet above): 3.35 TB/s; the driver reports 81,559 MiB (79.65 GiB) of its 80 GB
    Device("h100", "NVIDIA H100 80GB HBM3", _mib(81559), _HOPPER, 3350),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200/): H100's compute, 141 GB at 4.8 TB/s;
    # the driver reports 143,771 MiB (140.4 GiB)
    Device("h200", "NVIDIA H200", _mib(143771), _HOPPER, 4800),
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4/): FP32 30.3, TF32 60, BF16/FP16 121 TFLOPS
    # dense (242 with sparsity); 24 GB at 300 GB/s
    Device("l4", "NVIDIA L4", _gb(24), {"float32": 30.3, "tf32": 60, "bfloat16": 121, "float16": 121}, 300),
    # NVIDIA Ada whitepaper (images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf),
    # RTX 4090: FP32 82.6, BF16/FP16 tensor with FP32 accumulate 165.2 TFLOPS dense; 1,008 GB/s
    Device("rtx4090", "NVIDIA GeForce RTX 4090", _gb(24),
           {"float32": 82.6, "tf32": 82.6, "bfloat16": 165.2, "float16": 165.2}, 1008),
    # NVIDIA Ampere GA102 whitepaper (nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-
    # whitepaper-v2.pdf), RTX 3090: FP32 35.6, BF16/FP16 tensor with FP32 accumulate 71 TFLOPS dense; 936 GB/s
    Device("rtx3090", "NVIDIA GeForce RTX 3090", _gb(24),
           {"float32": 35.6, "tf32": 35.6, "bfloat16": 71, "float16": 71}, 936),
    # AMD Instinct MI300X datasheet (amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/
    # amd-instinct-mi300x-data-sheet.pdf): FP32 163.4, TF32 653.7, BF16/FP16 1,307.4 TFLOPS dense; 5.3 TB/s
    Device("mi300x", "AMD Instinct MI300X", _gb(192),
           {"float32": 163.4, "tf32": 653.7, "bfloat16": 1307.4, "float16": 1307.4}, 5300),
    # This machine's kind: memory only (no CUDA rounding or context), to check estimates against the
    # CPU's exact measurements; its times are a rough 2-core figure, not a claim.
    Device("cpu", "CPU", _gb(24), {"float32": 0.1, "bfloat16": 0.05, "float16": 0.05}, 20, cuda=False),
)}


def device_spec(name: str) -> Device:
    key = name.lower().replace(" ", "").replace("_", "-")
    if key not in DEVICES:
        raise MemfitError(f"unknown target {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]
