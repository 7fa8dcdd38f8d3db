"""Estimate mode: the profiler's own passes on fake tensors, for a device that is not at hand.

``estimate(build, target=...)`` builds the model under ``FakeTensorMode`` (no memory is
allocated; the CPU's flash-style SDPA path saves what CUDA's fused attention saves, unlike the
meta device's math path) and runs ``profile`` with two meters in place of the real ones: live
bytes of the fake storages (rounded as the CUDA caching allocator rounds them on CUDA targets),
and a roofline clock over the device's published figures (devices.py): both in measure/fake.py. Everything else, the
marks, the options, the phases, is the measuring profiler's, so the Profile has the same fields
and the planner cannot tell the difference, except by ``mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from memfit.devices import Device, device_spec
from memfit.errors import MemfitError
from memfit.formats.layout import ParallelLayout, layout_of
from memfit.formats.profile import Profile
from memfit.measure.fake import fake_meters
from memfit.measure.ranks import check_clipping, held_by_wrapper, make_mesh, shard
from memfit.profiler.autocast_lists import cuda_lists
from memfit.profiler.fake_build import fake_build, real_to_fake
from memfit.profiler.phases import ALTERNATE
from memfit.torch_private import FakeTensorMode, fake_store
from memfit.trainstep import TrainStep, step_of
from memfit.units import find_units


@contextmanager
def fake_ranks(layout: ParallelLayout | None) -> Iterator[Any]:
    """Rank 0 of the layout's ranks over the fake process group (its collectives move nothing), and
    their mesh, made before fake tensors are on (a mesh holds a real rank table)."""
    if layout is None:
        yield None
        return
    import torch.distributed as dist

    if dist.is_initialized():
        raise MemfitError("estimate(parallel=...) runs its own fake ranks; call it outside a distributed run")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=int(layout["world_size"]))
    try:
        yield make_mesh(layout, "cpu")
    finally:
        dist.destroy_process_group()


@contextmanager
def _fused_attention(fused: bool) -> Iterator[None]:
    """On CUDA targets, attention with dropout runs as one fused kernel that keeps q, k, v, the
    output and the log-sum-exp (and a seed), never the s×s matrix; fake CPU tensors would take
    the math path for dropout and keep it. Dropout's values do not matter on fake tensors, so
    the call goes to the fused path with dropout 0, which keeps what the GPU kernel keeps."""
    if not fused:
        yield
        return
    original = torch.nn.functional.scaled_dot_product_attention

    def fused_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        else:
            kwargs["dropout_p"] = 0.0
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = fused_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def estimate(
    build: Callable[[], Any],
    *,
    target: str | Device,
    units: str | list[str] = "auto",
    optimizer: str | None = "adamw",
    step: TrainStep | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    granularity: str = "module",
    children: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
    parallel: str | None = None,
    world_size: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> Profile:
    """A Profile for ``target`` (a name in devices.py: h100, a100-80gb, l4, …, or cpu) without
    the device and without allocating the model: ``build()`` returns ``(model, inputs)`` and is
    called under ``FakeTensorMode``; build low-precision models with ``torch.set_default_dtype``
    (``module.to(dtype)`` does not work on fake parameters). Times are a roofline of the
    target's published figures; memory is exact from shapes, as the CUDA allocator rounds it.

    ``parallel="fsdp"``: one rank of ``world_size`` under FSDP2 (``fully_shard`` on each unit and
    the root), in this process, over PyTorch's fake process group, whose collectives move no
    data: the shards, the gathered units and the reduce-scatter inputs are fake tensors like
    the rest. ``"ddp"``: the whole model per rank, plus DDP's gradient buckets.

    ``step``: the training step (memfit.TrainStep; ``optimizer=`` alone is short for
    ``step=TrainStep(optimizer=...)``). A plainly named optimizer runs the kernels PyTorch picks
    on the target: foreach on CUDA (a temporary per state tensor in the step), which fake CPU
    tensors would not take without being told. Autocast (``amp-*``) runs CUDA's op lists for a
    CUDA target (softmax, layer_norm, the losses in float32: profiler/autocast_lists.py), CPU's
    for the CPU."""
    from memfit.profiler import profile

    spec = target if isinstance(target, Device) else device_spec(target)
    layout = layout_of(parallel, world_size, tp, sequence_parallel) if parallel is not None else None
    if layout is not None:
        check_clipping(layout, step_of(step, optimizer).clip_grad_norm)
    with fake_ranks(layout) as mesh, faked(spec, build) as built:
        if not (isinstance(built, tuple) and len(built) == 2):
            raise MemfitError("build() must return (model, inputs)")
        model, inputs = built
        names = find_units(model, units)
        if layout is not None and mesh is not None:  # FSDP2 or TP: its fake ranks' mesh
            shard(model, names, layout, mesh)
        with fake_measuring(spec) as reserved:
            prof = profile(model, inputs, loss_fn=loss_fn, units=names, step=step_of(step, optimizer), repeat=1,
                           progress=progress, granularity=granularity, children=children)
        if layout is not None:
            prof.parallel = layout
            prof.baseline_bytes += held_by_wrapper(model, layout["kind"])
    return estimated(prof, spec, reserved)


@contextmanager
def faked(spec: Device, build: Callable[[], Any]) -> Iterator[Any]:
    """``build()``'s result, made under ``FakeTensorMode`` (real tensors it returns made fake),
    inside that mode and, for a CUDA target, CUDA's fused attention and autocast op lists."""
    with FakeTensorMode() as fake, _fused_attention(spec.cuda), cuda_lists() if spec.cuda else nullcontext():
        with fake_build(fake):
            built = build()
        yield real_to_fake(fake, built)


@contextmanager
def fake_measuring(spec: Device) -> Iterator[list[tuple[int, int]]]:
    """The profiler measuring with the fake meters for ``spec`` (the optimizer's kernels as PyTorch
    picks them on the target: foreach on CUDA); yields the list that each memory step's
    (allocated, reserved) peaks are added to, for ``estimated``."""
    from memfit.profiler import measuring_with

    reserved: list[tuple[int, int]] = []
    with measuring_with(fake_meters(spec, reserved), foreach_default=True if spec.cuda else None):
        yield reserved


def estimated(prof: Profile, spec: Device, reserved: list[tuple[int, int]]) -> Profile:
    """``prof``, measured with ``fake_measuring``'s meters, marked an estimate for ``spec``."""
    prof.mode, prof.target, prof.memory = "estimated", spec.name, spec.memory
    # the profiler's memory steps: one per all-units option, in the order of measured_peak_bytes,
    # then, where it needs them, the two alternating ones (profiler/phases.ALTERNATE), not kept here
    options = list(prof.measured_peak_bytes)
    if len(reserved) in (len(options), len(options) + len(ALTERNATE)):
        prof.reserved_peak_bytes = {o: r for o, (_, r) in zip(options, reserved[:len(options)], strict=True)}
    if spec.cuda:
        prof.device = "cuda"
        prof.rng_state_bytes = 0  # a CUDA checkpoint keeps its RNG state on the host
    return prof
