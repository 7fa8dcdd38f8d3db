"""The fake meters of estimate mode (profiler/estimate.py): live bytes of fake storages, rounded
as the CUDA caching allocator rounds them on CUDA targets, and a roofline clock over a device's
published figures. ``fake_meters`` hands them to the profiler, as meters.py hands it the real ones."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from memfit.devices import Device
from memfit.measure.allocator import MIN_BLOCK, CachingAllocator
from memfit.measure.host import take_served, under_dispatch_mode
from memfit.measure.inputs import iter_tensors
from memfit.measure.memory import Mark
from memfit.measure.meters import Meters
from memfit.measure.step import local, storage_key
from memfit.torch_private import TorchDispatchMode, inner_tensors, op_schema, saved_tensors_hooks_active

# Convolution kernels reorder their operands into scratch buffers (oneDNN on the CPU, cuDNN
# workspaces on CUDA) that fake tensors cannot show: allowed for as this many copies of the op's
# largest operand, live during the op. Fitted on the CPU to the ResNet-style test CNN, whose
# measured backward holds about two (tests/test_estimate.py); cuDNN's depend on the algorithm.
_WORKSPACE = {"convolution": 1, "convolution_backward": 2}
_WORKSPACE_KEY = object()  # the allocator model's name for a kernel's workspace, freed as soon as made
# what DTensor's collectives (functional collectives) wait on their results with
_WAIT = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT = getattr(_WAIT, "default", None)


def fake_meters(target: Device, reserved: list[tuple[int, int]] | None = None) -> Meters:
    """Estimate mode's meters for ``target``: live bytes of fake storages, a roofline clock;
    ``reserved`` gets each measured step's (allocated, reserved) peaks by the caching allocator's
    model (measure/allocator.py) on a CUDA target."""
    return Meters(lambda alive: FakeMemoryRecorder(target, alive, reserved), lambda: RooflineClock(target),
                  byte_masks=target.cuda, together=True)


class FakeMemoryRecorder(TorchDispatchMode):
    """Live bytes of the storages that ops create while it is active, each counted until its
    Python storage object is collected (PyTorch keeps one per storage while the storage lives),
    and the changes of storages resized in place (``_watch_resizes``); ``alive``: the tensors
    counted in the level the step starts from, whose frees during it count."""

    def __init__(self, target: Device, alive: Iterable[torch.Tensor] = (),
                 reserved: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self._cuda = target.cuda
        self._granule = MIN_BLOCK if target.cuda else 1  # the caching allocator's multiple
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes counted for it]
        self._level = self._peak = 0
        self._marks: list[Mark] = []
        self._static: list[weakref.finalize] = []  # the alive storages' (weak: they must be free to go)
        # the caching allocator's model, fed the same storages: ``reserved`` gets the step's
        # (allocated peak, reserved peak) when it ends
        self._allocator = CachingAllocator() if reserved is not None and target.cuda else None
        self._reserved_log = reserved
        for t in alive:
            st = local(t).untyped_storage()
            if st not in self._seen:
                counted = [self._rounded(st.nbytes())]
                self._seen[st] = counted
                self._static.append(weakref.finalize(st, self._free, counted))
                if self._allocator is not None:
                    self._allocator.malloc(id(counted), st.nbytes())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _WAIT:
            self._same_block(args[0], out)
        inputs = {storage_key(i.untyped_storage()) for t in iter_tensors((args, kwargs)) for i in inner_tensors(t)}
        for st in (i.untyped_storage() for t in iter_tensors(out) for i in inner_tensors(t)):  # a DTensor: its shard
            if storage_key(st) not in inputs and st not in self._seen:  # new storage: not a view, not in place
                counted = [self._rounded(st.nbytes())]
                self._seen[st] = counted
                self._level += counted[0]
                self._peak = max(self._peak, self._level)
                weakref.finalize(st, self._free, counted)
                if self._allocator is not None:
                    self._allocator.malloc(id(counted), st.nbytes())
        if self._cuda and func is torch.ops.aten.bernoulli_.float:
            self._as_byte_mask(args[0])
        workspace = _WORKSPACE.get(func._overloadpacket.__name__, 0)
        if workspace:  # buffers the kernel allocates and frees inside itself, which no tensor shows
            largest = max((t.numel() * t.element_size() for t in iter_tensors((args, kwargs))), default=0)
            self._peak = max(self._peak, self._level + workspace * largest)
            if self._allocator is not None:  # cuDNN takes its workspace from the caching allocator too
                self._allocator.malloc(_WORKSPACE_KEY, workspace * largest)
                self._allocator.free(_WORKSPACE_KEY)
        return out

    def __enter__(self) -> FakeMemoryRecorder:
        self._unwatch = _watch_resizes(self._resized)
        try:
            return super().__enter__()
        except BaseException:
            self._unwatch()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unwatch()
            for f in self._static:  # parameters outlive many recorders: none keeps this one
                f.detach()
            if self._allocator is not None and self._reserved_log is not None:
                self._reserved_log.append((self._allocator.peak_allocated, self._allocator.peak_reserved))
                self._allocator = None  # the storages that outlive the step free nothing here any more

    def _same_block(self, waited: torch.Tensor, out: torch.Tensor) -> None:
        """A collective's wait returns the very tensor it waited for on every backend, where fake
        tensors make a new storage: the count moves to the new one (which outlives the other, an
        ``AsyncCollectiveTensor``'s), instead of a second block the size of a collective's output."""
        old, new = waited.untyped_storage(), out.untyped_storage()
        counted = self._seen.get(old)
        if new is old or counted is None or new in self._seen:
            return
        moved = [counted[0]]
        counted[0] = 0
        self._seen[new] = moved
        weakref.finalize(new, self._free, moved)
        if self._allocator is not None:
            self._allocator.free(id(counted))
            self._allocator.malloc(id(moved), new.nbytes())

    def _resized(self, st: torch.UntypedStorage, old: int, new: int) -> None:
        """A storage resized in place: FSDP2 frees each gathered unit's buffer with ``resize_(0)``
        after use and allocates it again with ``resize_(n)`` before the next gather."""
        counted = self._seen.get(st)
        if counted is None:  # made before this recorder: only its changes count
            counted = [0]
            self._seen[st] = counted
            weakref.finalize(st, self._free, counted)
        delta = self._rounded(new) - self._rounded(old)
        if self._allocator is not None:  # FSDP2's gathered buffers: freed with resize_(0), made again with resize_(n)
            self._allocator.free(id(counted))
            if new:
                self._allocator.malloc(id(counted), new)
        counted[0] += delta
        self._level += delta
        self._peak = max(self._peak, self._level)

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self._granule) * self._granule

    def _as_byte_mask(self, mask: torch.Tensor) -> None:
        """Dropout's mask, which the CPU's kernel makes in the input's dtype (``empty_like``,
        ``bernoulli_``) and CUDA's fused ``native_dropout`` keeps as one byte per element."""
        counted = self._seen.get(mask.untyped_storage())
        if counted is not None and mask.element_size() > 1:
            smaller = self._rounded(mask.numel())
            self._level -= counted[0] - smaller
            counted[0] = smaller
            if self._allocator is not None:
                self._allocator.free(id(counted))
                self._allocator.malloc(id(counted), mask.numel())

    def _free(self, counted: list[int]) -> None:
        self._level -= counted[0]
        if self._allocator is not None:
            self._allocator.free(id(counted))

    def on_mark(self, label: str) -> None:
        self._marks.append(Mark(label, self._level, self._peak))
        self._peak = self._level

    def marks(self) -> list[Mark]:
        return self._marks


def _watch_resizes(on_resize: Callable[[torch.UntypedStorage, int, int], None]) -> Callable[[], None]:
    """Report every ``UntypedStorage.resize_`` to ``on_resize(storage, old bytes, new bytes)``
    until the returned undo is called. A storage resized in place runs no op a dispatch mode
    sees, and PyTorch has no hook for it, so the method itself is wrapped for the duration (as
    FSDP2's ``alloc_storage`` / ``free_storage`` call it, torch 2.13)."""
    cls = torch.UntypedStorage
    own = "resize_" in cls.__dict__
    original = cls.resize_

    def resize_(st: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        old = st.nbytes()
        out = original(st, size)
        on_resize(st, old, st.nbytes())
        return out

    cls.resize_ = resize_  # type: ignore[method-assign]

    def undo() -> None:
        if own:
            cls.resize_ = original  # type: ignore[method-assign]
        else:
            del cls.resize_

    return undo


# what the dispatch modes above the clock call themselves while handling an op (the cache's
# detached copies) and what only fake tensors dispatch (a device query): priced in the op's time
_MODES_OWN = {torch.ops.aten.detach.default, torch.ops.prim.device.default}


class RooflineClock(TorchDispatchMode):
    """Estimated seconds of the ops run while it is active: ``Device.seconds`` of each op's
    FLOPs (PyTorch's own flop formulas; attention as one fused kernel) and bytes moved, no less
    than the host's launch time, the host's hook time for an op that runs while a Python
    saved-tensor hook is in force (its saved tensors go through Python: memfit's derive,
    checkpoint regions and their recomputation), and the dispatch time of one that passes
    through an op set's Python dispatch modes (SAC's, forward and recomputation), so that
    options whose own cost is on the host are priced on a card whose kernels take microseconds."""

    def __init__(self, target: Device) -> None:
        super().__init__()
        self._target = target
        self._seconds = 0.0
        self._marks: list[Mark] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        dispatched = under_dispatch_mode()
        if dispatched:  # the modes above pay for views too, and for the ops they will serve from a cache
            self._seconds += self._target.dispatch_s * take_served()
        if _metadata_only(func, args, kwargs, out):  # a view, a size, a device: no kernel runs, nothing moves
            if dispatched and func not in _MODES_OWN:  # a view the modes handle as any op
                self._seconds += self._target.dispatch_s
            return out
        tensors = [t for t in iter_tensors((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        self._seconds += self._target.seconds(_flops(func, args, kwargs, out), moved, dtype,
                                              saved_tensors_hooks_active(), dispatched)
        return out

    def __enter__(self) -> RooflineClock:
        take_served()  # ops an earlier step's modes counted after its clock's last op are not this step's
        return super().__enter__()

    def on_mark(self, label: str) -> None:
        # ops counted since the last op that reached this clock: a stretch pays for its own
        self._seconds += self._target.dispatch_s * take_served()
        self._marks.append(Mark(label, 0, 0, self._seconds))

    def marks(self) -> list[Mark]:
        return self._marks


def _metadata_only(func: Any, args: Any, kwargs: Any, out: Any) -> bool:
    """The op reads and writes no data: every tensor it returns shares an input's storage (a view:
    ``view``, ``t``, ``transpose``, ``detach``, ``expand``, ``_unsafe_view``), or it returns none
    (``prim.device``, ``sym_size``). In-place ops return their input too, but write it: their
    schemas are mutable, and they count."""
    if op_schema(func).is_mutable:
        return False
    inputs = {storage_key(t.untyped_storage()) for t in iter_tensors((args, kwargs))}
    return all(storage_key(t.untyped_storage()) in inputs for t in iter_tensors(out))


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
