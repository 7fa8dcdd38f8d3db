"""Wrapping a model for several ranks as a training script does (FSDP2's ``fully_shard`` per unit
and on the root, or ``DistributedDataParallel``), and what the wrapper itself holds: used by the
ranks that parallel.py spawns and by estimate mode's fake ranks alike."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.formats.profile import PARALLEL


def is_fsdp(kind: str) -> bool:
    """FSDP2, with or without mixed precision."""
    return kind.startswith("fsdp")


def shard(model: nn.Module, units: list[str], parallel: str, mesh: Any = None) -> nn.Module:
    """FSDP2 on each unit then the root (in place), or DDP around the model (a new wrapper).
    ``mesh``: the FSDP2 device mesh, made here over every rank when not given."""
    import torch.distributed as dist

    if is_fsdp(parallel):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if mesh is None:
            device = "cuda" if next(model.parameters()).is_cuda else "cpu"
            mesh = init_device_mesh(device, (dist.get_world_size(),))
        # bf16: units gather and compute in bf16 and reduce gradients in fp32 (the sharded
        # parameters, gradients and optimizer state stay fp32), as mixed-precision FSDP2 runs
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if parallel == "fsdp-bf16" else None
        extra = {"mp_policy": policy} if policy is not None else {}
        for name in units:
            fully_shard(model.get_submodule(name), mesh=mesh, **extra)
        fully_shard(model, mesh=mesh, **extra)
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    raise MemfitError(f"unknown parallelism {parallel!r}; use one of {', '.join(PARALLEL)}")


def check_parallel(parallel: str, world_size: int) -> None:
    """Refuse a parallelism memfit cannot plan, or fewer than two ranks."""
    if parallel not in PARALLEL:
        raise MemfitError(f"unknown parallelism {parallel!r}; use one of {', '.join(PARALLEL)}")
    if world_size < 2:
        raise MemfitError(f"--world-size must be at least 2 for {parallel}, got {world_size}")


def held_by_wrapper(model: nn.Module, parallel: str) -> int:
    """Bytes the parallel wrapper itself keeps across steps, which no parameter, gradient or
    optimizer tensor shows: DDP's gradient buckets, a second copy of every trainable gradient
    (``gradient_as_bucket_view=False``, its default), from shapes. (Measuring them on the CPU
    was not repeatable: gloo's threads allocate some of them outside the profiler's view.)"""
    from memfit.measure.step import storage_bytes

    return storage_bytes([p for p in model.parameters() if p.requires_grad]) if parallel == "ddp" else 0
