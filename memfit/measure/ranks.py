"""Wrapping a model for several ranks as a training script does (FSDP2's ``fully_shard`` per unit
and on the root, or ``DistributedDataParallel``), and what the wrapper itself holds: used by the
ranks that steps/parallel.py spawns and by estimate mode's fake ranks alike."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.formats.layout import ParallelLayout, check_layout, dp_degree, tp_degree
from memfit.torch_private import unset_fake_temporarily
from memfit.units import matches


def is_fsdp(kind: str) -> bool:
    """FSDP2, with or without mixed precision."""
    return kind.startswith("fsdp")


def make_mesh(layout: ParallelLayout, device: str) -> Any:
    """The ranks' device mesh: one dimension over every rank, or FSDP2's shards by tensor-parallel
    groups (``("dp_shard", "tp")``, torchtitan's names); None for DDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout["kind"] == "ddp":
        return None
    if layout["kind"] != "tp" and tp_degree(layout) > 1:
        return init_device_mesh(device, (dp_degree(layout), tp_degree(layout)), mesh_dim_names=("dp_shard", "tp"))
    return init_device_mesh(device, (int(layout["world_size"]),))


def pipeline_mesh(layout: ParallelLayout, pp: int, device: str) -> tuple[Any, Any]:
    """A pipeline of ``pp`` ranks whose stages each ``layout``'s ranks hold: torchtitan's
    ``("pp", "dp_shard", "tp")`` mesh, and the part of it a stage is sharded on (``shard``'s mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    inner, tp = int(layout["world_size"]), tp_degree(layout)
    mesh = init_device_mesh(device, (pp, inner // tp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))
    return mesh, mesh["tp"] if layout["kind"] == "tp" else mesh["dp_shard", "tp"] if tp > 1 else mesh["dp_shard"]


def shard(model: nn.Module, units: list[str], layout: ParallelLayout, mesh: Any = None, *,
          pipeline: bool = False) -> nn.Module:
    """Tensor parallelism by the model's own plan (``tp_plan``, in place), then FSDP2 on each unit
    and the root over the data-parallel shards (in place); or DDP around the model (a new wrapper).
    ``mesh``: the device mesh (``make_mesh``), made here over every rank when not given.
    ``pipeline``: the model is a pipeline stage, whose FSDP2 units keep their parameters gathered
    after the forward, as torchtitan shards stages (the micro-batches' forwards would gather
    them again each time)."""
    check_layout(layout)
    kind = layout["kind"]
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mesh is None:
        mesh = make_mesh(layout, "cuda" if next(model.parameters()).is_cuda else "cpu")
    if tp_degree(layout) > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = mesh["tp"] if mesh.ndim == 2 else mesh
        parallelize_module(model, tp_mesh, tp_plan(model, tp_mesh.size(), bool(layout.get("sequence_parallel"))))
        if layout.get("sequence_parallel"):
            _stage_boundaries(model, tp_mesh)
    if is_fsdp(kind):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = mesh["dp_shard"] if mesh.ndim == 2 else mesh
        # bf16: units gather and compute in bf16 and reduce gradients in fp32 (the sharded
        # parameters, gradients and optimizer state stay fp32), as mixed-precision FSDP2 runs
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if kind == "fsdp-bf16" else None
        extra: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
        if pipeline:
            extra["reshard_after_forward"] = False
        # over tensor-parallel parameters FSDP2 makes a mesh of both dimensions from a tensor of
        # rank numbers, which must be a real one under estimate mode's fake tensors
        with unset_fake_temporarily():
            for name in units:
                fully_shard(model.get_submodule(name), mesh=dp_mesh, **extra)
            fully_shard(model, mesh=dp_mesh, **extra)
    return model


# Hugging Face's names for the styles of a config's ``base_model_tp_plan``, those PyTorch's parallel
# styles say exactly (its others, such as "colwise_rep" or "local_rowwise", are refused), and the
# weight dimension each shards: "embedding_rowwise" is vocabulary-parallel (each rank looks up its
# rows, the partial lookups summed), which is what RowwiseParallel does to an nn.Embedding given
# the token ids whole (its default reads an input sharded on the last dimension, as a Linear's)
_HF_STYLES = {"colwise": ("ColwiseParallel", 0), "rowwise": ("RowwiseParallel", 1),
              "embedding_rowwise": ("RowwiseParallel", 0)}


def tp_plan(model: nn.Module, degree: int, sequence_parallel: bool = False) -> dict[str, Any]:
    """Tensor parallelism as the model's own Hugging Face config declares it (``base_model_tp_plan``:
    column-wise q, k, v and MLP input products, row-wise output products), in PyTorch's parallel
    styles; a MemfitError for a model without one, a style memfit does not know, or a sharded
    dimension ``degree`` does not divide. ``sequence_parallel``: as torchtitan runs Llama (Korthikanti
    et al.'s sequence parallelism), the residual stream between the products sharded along the
    sequence (``sequence_plan``)."""
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
    if sequence_parallel:
        return sequence_plan(model, plan, base, degree)
    from torch.distributed.tensor import Replicate

    return {key: getattr(styles, _HF_STYLES[style][0])(
        **({"input_layouts": Replicate()} if style == "embedding_rowwise" else {})) for key, style in plan.items()}


def sequence_plan(model: nn.Module, plan: dict[str, str], base: str, degree: int) -> dict[str, Any]:
    """The config's plan with sequence parallelism, as torchtitan writes it for Llama: the
    embedding's output (the embedding split by vocabulary rows, where the config leaves it whole),
    the norms on the residual stream (children of a layer or of the base model) and the row-wise
    products' outputs sharded along the sequence (``Shard(1)``); the modules that hold column-wise
    products (attention, MLP) gather their input whole first; the output embedding column-wise,
    from the sequence shards to whole logits (the loss is the model's own)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    out: dict[str, Any] = {}
    for key, style in plan.items():
        if style == "colwise":
            out[key] = ColwiseParallel()
            out.setdefault(key.rsplit(".", 1)[0], _whole_sequence()())
        elif style == "rowwise":
            out[key] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        else:  # embedding_rowwise
            out[key] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    names = {id(m): n for n, m in model.named_modules()}
    # a pipeline stage (hf.DecoderStage) has the input embedding on the first stage only and the
    # head on the last: the others take and give the sequence shards (``_stage_boundaries``)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    for module in (embedding, head):
        if module is not None and module.weight.shape[0] % degree:
            raise MemfitError(f"{names[id(module)]}'s {module.weight.shape[0]} vocabulary rows do not divide among "
                              f"{degree} tensor-parallel ranks")
    if embedding is not None and not any(matches(names[id(embedding)], key) for key in out):
        # vocabulary-parallel, as torchtitan's Llama
        out[names[id(embedding)]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                    use_local_output=False)
    if head is not None:
        if embedding is not None and head.weight is embedding.weight:
            raise MemfitError(f"{type(model).__name__} ties its output embedding to its input embedding; memfit's "
                              "sequence-parallel plan shards them apart (plan tensor parallelism without it)")
        out[names[id(head)]] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    layers = {key.split(".*.")[0] + ".*" for key in plan if ".*." in key}
    for name, module in model.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        on_stream = parent == base.rstrip(".") or any(matches(parent, layer) for layer in layers)
        if on_stream and "norm" in type(module).__name__.lower():
            out[name] = SequenceParallel()
    return out


def _stage_boundaries(model: nn.Module, tp_mesh: Any) -> None:
    """Under sequence parallelism, a pipeline stage that lacks the input embedding takes its
    rank's sequence shard of the hidden states (a plain tensor, as the pipeline sends it) and makes
    it the DTensor the residual stream is; one that lacks the head gives its shard back as a plain
    tensor: what torchtitan's stages send between them (b, s / tp, h)."""
    from torch.distributed.tensor import DTensor, Shard

    if model.get_input_embeddings() is None:
        model.register_forward_pre_hook(lambda _m, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)],
                                                                             run_check=False), *args[1:]))
    if model.get_output_embeddings() is None:
        model.register_forward_hook(lambda _m, _a, out: out.to_local() if isinstance(out, DTensor) else out)


@functools.cache
def _whole_sequence() -> type:
    """A parallel style: a module's inputs sharded along the sequence gathered whole (local
    tensors) before it runs, whether the model passes them by position or by name (Hugging Face's
    attention takes ``hidden_states=``), which ``PrepareModuleInput`` needs to be told in advance.
    Made on first use, so that importing memfit does not import torch.distributed's styles."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    class WholeSequence(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def whole(t: Any) -> Any:
                return t.redistribute(device_mesh, [Replicate()]).to_local() if isinstance(t, DTensor) else t

            def gather(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

            module.register_forward_pre_hook(gather, with_kwargs=True)
            return module

    return WholeSequence


def check_clipping(layout: ParallelLayout, clip_grad_norm: float | None) -> None:
    """Refuse a step that clips gradients under tensor parallelism without sequence parallelism:
    the config's plan leaves the norms and embeddings plain tensors (beside FSDP2, on its mesh
    dimension alone) while the products are DTensors of the tensor-parallel one, and
    ``clip_grad_norm_`` cannot mix them (PyTorch's error, on every rank)."""
    if clip_grad_norm is not None and tp_degree(layout) > 1 and not layout.get("sequence_parallel"):
        raise MemfitError("clipping gradients (clip_grad_norm_) under tensor parallelism needs --sequence-parallel, "
                          "as torchtitan runs it: every parameter then lives on the tensor-parallel mesh; without it "
                          "PyTorch's clip_grad_norm_ refuses the mix of sharded products and whole norms")


def held_by_wrapper(model: nn.Module, parallel: str) -> int:
    """Bytes the parallel wrapper itself keeps across steps, which no parameter, gradient or
    optimizer tensor shows: DDP's gradient buckets, a second copy of every trainable gradient
    (``gradient_as_bucket_view=False``, its default), from shapes. (Measuring them on the CPU
    was not repeatable: gloo's threads allocate some of them outside the profiler's view.)"""
    from memfit.measure.step import storage_bytes

    return storage_bytes([p for p in model.parameters() if p.requires_grad]) if parallel == "ddp" else 0
