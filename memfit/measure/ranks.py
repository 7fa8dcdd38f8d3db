"""Wrapping a model for several ranks as a training script does (FSDP2's ``fully_shard`` per unit
and on the root, or ``DistributedDataParallel``), and what the wrapper itself holds: used by the
ranks that parallel.py spawns and by estimate mode's fake ranks alike."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.formats.profile import PARALLEL
from memfit.units import matches


def is_fsdp(kind: str) -> bool:
    """FSDP2, with or without mixed precision."""
    return kind.startswith("fsdp")


def shard(model: nn.Module, units: list[str], parallel: str, mesh: Any = None) -> nn.Module:
    """FSDP2 on each unit then the root (in place), DDP around the model (a new wrapper), or
    tensor parallelism by the model's own plan (``tp_plan``, in place). ``mesh``: the device
    mesh, made here over every rank when not given."""
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
    if parallel == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        if mesh is None:
            device = "cuda" if next(model.parameters()).is_cuda else "cpu"
            mesh = init_device_mesh(device, (dist.get_world_size(),))
        parallelize_module(model, mesh, tp_plan(model, mesh.size()))
        return model
    raise MemfitError(f"unknown parallelism {parallel!r}; use one of {', '.join(PARALLEL)}")


# Hugging Face's names for the styles of a config's ``base_model_tp_plan``, those PyTorch's parallel
# styles say exactly (its others, such as "colwise_rep" or "local_rowwise", are refused), and the
# weight dimension each shards: "embedding_rowwise" is vocabulary-parallel (each rank looks up its
# rows, the partial lookups summed), which is what RowwiseParallel does to an nn.Embedding given
# the token ids whole (its default reads an input sharded on the last dimension, as a Linear's)
_HF_STYLES = {"colwise": ("ColwiseParallel", 0), "rowwise": ("RowwiseParallel", 1),
              "embedding_rowwise": ("RowwiseParallel", 0)}


def tp_plan(model: nn.Module, degree: int) -> dict[str, Any]:
    """Tensor parallelism as the model's own Hugging Face config declares it (``base_model_tp_plan``:
    column-wise q, k, v and MLP input products, row-wise output products), in PyTorch's parallel
    styles; a MemfitError for a model without one, a style memfit does not know, or a sharded
    dimension ``degree`` does not divide."""
    import torch.distributed.tensor.parallel as styles

    config = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        raise MemfitError(f"--parallel tp needs the model's own tensor-parallel plan, which {type(model).__name__} "
                          "does not declare (a Hugging Face config's base_model_tp_plan); for another model, apply "
                          "parallelize_module yourself and profile it on every rank (docs/guide.md)")
    unknown = sorted({style for style in declared.values() if style not in _HF_STYLES})
    if unknown:
        raise MemfitError(f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}, which memfit does "
                          f"not apply; it knows {', '.join(_HF_STYLES)}")
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    plan = {f"{base}{key}": style for key, style in declared.items()}
    for name, module in model.named_modules():
        style = next((s for key, s in plan.items() if matches(name, key)), None)
        weight = getattr(module, "weight", None)
        if style is not None and weight is not None:
            dim = _HF_STYLES[style][1]  # a Linear's weight is (outputs, inputs), an Embedding's (vocabulary, width)
            if weight.shape[dim] % degree:
                what = "vocabulary rows" if style == "embedding_rowwise" else "outputs" if dim == 0 else "inputs"
                raise MemfitError(f"{name}'s {weight.shape[dim]} {what} do not divide among {degree} tensor-parallel "
                                  "ranks")
    from torch.distributed.tensor import Replicate

    return {key: getattr(styles, _HF_STYLES[style][0])(
        **({"input_layouts": Replicate()} if style == "embedding_rowwise" else {})) for key, style in plan.items()}


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
