"""Estimate mode: the profiler's own passes on fake tensors, for a device that is not at hand.

``estimate(build, target=...)`` builds the model under ``FakeTensorMode`` (no memory is
allocated; the CPU's flash-style SDPA path saves what CUDA's fused attention saves, unlike the
meta device's math path) and runs ``profile`` with two meters in place of the real ones: live
bytes of the fake storages (rounded as the CUDA caching allocator rounds them on CUDA targets),
and a roofline clock over the device's published figures (devices.py). Everything else, the
marks, the options, the phases, is the measuring profiler's, so the Profile has the same fields
and the planner cannot tell the difference, except by ``mode``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from memfit.devices import Device
from memfit.errors import MemfitError
from memfit.measure.memory import Mark
from memfit.measure.step import iter_tensors, storage_key
from memfit.profile import Profile
from memfit.units import find_units

_ACTIVE: list[Device] = []
CUDA_GRANULE = 512  # the caching allocator hands out multiples of 512 bytes
# Convolution kernels reorder their operands into scratch buffers (oneDNN on the CPU, cuDNN
# workspaces on CUDA) that fake tensors cannot show: allowed for as this many copies of the op's
# largest operand, live during the op. Fitted on the CPU to the ResNet-style test CNN, whose
# measured backward holds about two (tests/test_estimate.py); cuDNN's depend on the algorithm.
_WORKSPACE = {"convolution": 1, "convolution_backward": 2}


def active() -> Device | None:
    """The target being estimated for, inside ``estimating``."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def estimating(target: Device) -> Iterator[None]:
    _ACTIVE.append(target)
    try:
        yield
    finally:
        _ACTIVE.pop()


class FakeMemoryRecorder(TorchDispatchMode):
    """Live bytes of the storages that ops create while it is active, each counted until its
    Python storage object is collected (PyTorch keeps one per storage while the storage lives)."""

    def __init__(self, target: Device) -> None:
        super().__init__()
        self._granule = CUDA_GRANULE if target.cuda else 1
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._level = self._peak = 0
        self._marks: list[Mark] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t.untyped_storage()) for t in iter_tensors((args, kwargs))}
        for t in iter_tensors(out):
            st = t.untyped_storage()
            if storage_key(st) not in inputs and st not in self._seen:  # new storage: not a view, not in place
                size = -(-st.nbytes() // self._granule) * self._granule
                self._seen[st] = size
                self._level += size
                self._peak = max(self._peak, self._level)
                weakref.finalize(st, self._free, size)
        workspace = _WORKSPACE.get(func._overloadpacket.__name__, 0)
        if workspace:  # buffers the kernel allocates and frees inside itself, which no tensor shows
            largest = max((t.numel() * t.element_size() for t in iter_tensors((args, kwargs))), default=0)
            self._peak = max(self._peak, self._level + workspace * largest)
        return out

    def _free(self, size: int) -> None:
        self._level -= size

    def on_mark(self, label: str) -> None:
        self._marks.append(Mark(label, self._level, self._peak))
        self._peak = self._level

    def marks(self) -> list[Mark]:
        return self._marks


class RooflineClock(TorchDispatchMode):
    """Estimated seconds of the ops run while it is active: ``Device.seconds`` of each op's
    FLOPs (PyTorch's own flop formulas; attention as one fused kernel) and bytes moved."""

    def __init__(self, target: Device) -> None:
        super().__init__()
        self._target = target
        self._seconds = 0.0
        self._marks: list[Mark] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in iter_tensors((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        self._seconds += self._target.seconds(_flops(func, args, kwargs, out), moved, dtype)
        return out

    def on_mark(self, label: str) -> None:
        self._marks.append(Mark(label, 0, 0, self._seconds))

    def marks(self) -> list[Mark]:
        return self._marks


def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> float:
    packet = func._overloadpacket
    count: Callable[..., int] | None = flop_registry.get(packet)
    if count is not None:
        return float(count(*args, **kwargs, out_val=out))
    name = packet.__name__
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        # The CPU's flash kernel, standing in for the target's fused attention: two products of
        # B·H·Tq·Tk·D multiply-adds forward; the backward recomputes one and adds three.
        q = args[1] if name.endswith("backward") else args[0]
        k = args[2] if name.endswith("backward") else args[1]
        b, h, tq, d = q.shape
        per = 2.0 * b * h * tq * k.shape[-2] * d
        return per * (4 if name.endswith("backward") else 2)
    return 0.0


@contextmanager
def _fake_ranks(parallel: str | None, world_size: int) -> Iterator[Any]:
    """Rank 0 of ``world_size`` over the fake process group (its collectives move nothing), and
    the FSDP2 mesh, made before fake tensors are on (a mesh holds a real rank table)."""
    if parallel is None:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # Private: PyTorch's own fake process group for tracing distributed code without peers.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memfit.parallel import check_parallel, is_fsdp

    check_parallel(parallel, world_size)
    if dist.is_initialized():
        raise MemfitError("estimate(parallel=...) runs its own fake ranks; call it outside a distributed run")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,)) if is_fsdp(parallel) else None
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
    target: str,
    units: str | list[str] = "auto",
    optimizer: str | None = "adamw",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    granularity: str = "module",
    children: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
    parallel: str | None = None,
    world_size: int = 1,
) -> Profile:
    """A Profile for ``target`` (a name in devices.py: h100, a100-80gb, l4, …, or cpu) without
    the device and without allocating the model: ``build()`` returns ``(model, inputs)`` and is
    called under ``FakeTensorMode``; build low-precision models with ``torch.set_default_dtype``
    (``module.to(dtype)`` does not work on fake parameters). Times are a roofline of the
    target's published figures; memory is exact from shapes, as the CUDA allocator rounds it.

    ``parallel="fsdp"``: one rank of ``world_size`` under FSDP2 (``fully_shard`` on each unit and
    the root), in this process, over PyTorch's fake process group, whose collectives move no
    data: the shards, the gathered units and the reduce-scatter inputs are fake tensors like
    the rest. ``"ddp"``: the whole model per rank, plus DDP's gradient buckets."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.devices import device_spec
    from memfit.profiler import profile

    spec = device_spec(target)
    with _fake_ranks(parallel, world_size) as mesh, FakeTensorMode(), estimating(spec), _fused_attention(spec.cuda):
        built = build()
        if not (isinstance(built, tuple) and len(built) == 2):
            raise MemfitError("build() must return (model, inputs)")
        model, inputs = built
        names = find_units(model, units)
        if parallel and mesh is not None:  # FSDP2: its fake ranks' mesh
            from memfit.parallel import shard

            shard(model, names, parallel, mesh)
        prof = profile(model, inputs, loss_fn=loss_fn, units=names, optimizer=optimizer, repeat=1,
                       progress=progress, granularity=granularity, children=children)
        if parallel is not None:
            from memfit.parallel import held_by_wrapper

            prof.parallel = {"kind": parallel, "world_size": world_size}
            prof.baseline_bytes += held_by_wrapper(model, parallel)
    prof.mode, prof.target = "estimated", spec.name
    if spec.cuda:
        prof.device = "cuda"
        prof.rng_state_bytes = 0  # a CUDA checkpoint keeps its RNG state on the host
    return prof
