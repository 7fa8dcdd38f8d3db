"""Peak-memory meters: exact live-tensor bytes on the CPU, allocator statistics on CUDA.

Both report marks: the live bytes at a labelled moment and the highest live bytes since the
previous mark, relative to where the meter started. The profiler marks unit boundaries; a
plain measurement marks only the start and the end.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import torch

from memfit.devices import MemoryRecord
from memfit.errors import MemfitError
from memfit.measure.step import local, storage_bytes
from memfit.torch_private import ProfiledAllocation, ProfiledOp, inner_tensors, is_fake

T = TypeVar("T")


@dataclass(slots=True)
class Mark:
    label: str
    level: int  # live bytes at the mark, relative to the step's start
    peak: int  # highest live bytes since the previous mark, relative to the step's start
    time_s: float = 0.0
    work_s: float = 0.0  # seconds of the options' own work since the step's start (``host.Work``; a real CPU clock's)


@contextmanager
def gc_held() -> Iterator[None]:
    """Python's cyclic collector held off until the block ends (as ``timeit`` does). A collection
    inside a measured step frees tensors of earlier steps' reference cycles (another test's model,
    the user's last batch), which the CUDA allocator's figures see, and takes its time from the
    step; and in a fixed order of steps it lands on the same configuration round after round. No
    collection first: a full one takes 0.2 s in a process that has imported torch, a third of a
    small model's profile, and the meters need none (a free is seen only of a block they count)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CpuMemoryRecorder:
    """Exact live bytes on the CPU from the allocator's own events (the CPU allocator does not
    cache), read from the profiler's event tree (``kineto_results.experimental_event_tree()``, a
    private but long-stable surface): the public events carry neither every allocation nor the
    block's address.

    The allocator reports a free only of a block it saw made while a profiler ran, at the size it
    noted then, and keeps that note after a free it did not report: a block made earlier at that
    address is freed at the old size (a CPU step read up to 64 KiB low at random). So a free
    counts only of a block made while recording, and the frees of ``alive`` (the tensors counted in
    the level the step starts from: a step function's gradients, freed at its zero_grad) are marked
    by the storages' own finalizers (PyTorch keeps a storage's Python object while the storage
    lives).

    The profiler hears only the threads it runs in (``profile_all_threads`` drops memory events:
    pytorch#166121): a block freed on another thread has no free. Gloo's collectives copy their
    input on the calling thread and free the copy on a worker, now and then after the call has
    returned; and a collective's work holds its input and output tensors until its worker thread
    lets it go, which on a busy CPU may be well after the caller dropped them. A block whose free
    went unheard so went at the end of the last op that used it (an op's inputs, recorded in a
    process group: ``_cpu_events``), and at the latest when a new block took its address; one made
    inside a collective, or used, and never seen to go went then too, unless a tensor Python can
    reach at the recording's end is on it (a functional collective's output may be a gradient)."""

    def __init__(self, alive: Iterable[torch.Tensor] = ()) -> None:
        self._prof: Any = None
        self._inputs = in_process_group()  # record each op's inputs: see _cpu_events
        self._live: set[int] = set()
        self._alive: dict[int, int] = {}  # address -> bytes (no reference: they must be free to go)
        self._watch: list[weakref.finalize] = []
        for t in map(local, alive):
            if t.device.type != "cpu" or is_fake(t):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr and ptr not in self._alive:
                self._alive[ptr] = st.nbytes()
                self._watch.append(weakref.finalize(st, _gone, ptr))

    def __enter__(self) -> CpuMemoryRecorder:
        self._gc = gc_held()
        self._gc.__enter__()
        self._quiet = _filtered_stderr()
        self._quiet.__enter__()
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
            record_shapes=self._inputs,
        )
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for f in self._watch:
                f.detach()
            self._prof.__exit__(*exc)
            if self._inputs:
                self._live = _live_blocks()
        finally:
            self._quiet.__exit__(*exc)
            self._gc.__exit__(*exc)

    def on_mark(self, label: str) -> None:
        with torch.profiler.record_function(f"memfit:{label}"):
            pass

    def marks(self) -> list[Mark]:
        events, uses = _cpu_events(self._prof, inputs=self._inputs)
        return marks_of(_with_unseen_frees(events, uses, self._live), self._alive)


def in_process_group() -> bool:
    """Whether this process runs collectives, whose worker threads free blocks unheard."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def marks_of(events: list[Event], alive: dict[int, int]) -> list[Mark]:
    """The marks of a recording's ``events`` (``_cpu_events``), ``alive`` being the static blocks
    (address -> bytes) counted in the level it started from."""
    out: list[Mark] = []
    made: dict[int, int] = {}  # address -> bytes of the blocks made while recording, still live
    alive = dict(alive)
    level = peak = 0
    for _, kind, ptr, nbytes, label, _ in events:
        if kind == _MARK:
            out.append(Mark(label, level, peak))
            peak = level
        elif kind == _GONE or (kind == _ALLOC and ptr in alive):  # a static block went (a new
            level -= alive.pop(ptr, 0)  # one at its address: it went unmarked, before that)
        if kind == _ALLOC:
            level -= made.pop(ptr, 0)  # a block at this address went unheard (another thread)
            made[ptr] = nbytes
            level += nbytes
            peak = max(peak, level)
        elif kind == _FREE and ptr in made:
            level -= made.pop(ptr)
    return out


def _gone(ptr: int) -> None:
    """A static block's storage went: a mark in the recording's events."""
    with torch.profiler.record_function(f"memfit-gone:{ptr}"):
        pass


def peak_from(marks: list[Mark], static: int) -> int:
    """A measured stretch's peak: the ``static`` level it started from (the bytes of the tensors
    the recorder was told were alive) plus the highest rise over its first mark."""
    return static + max(m.peak for m in marks) - marks[0].level


def measured(run: Callable[[], T], static: Callable[[], Iterable[torch.Tensor]],
             device: torch.device | None = None) -> tuple[T, int, CudaFigures | None]:
    """``run()``'s result, its peak and, on CUDA, the card's own figures. The peak is the bytes of
    the tensors ``static()`` lists (those alive at the start that the caller counts) plus the
    highest rise over them; a function, so that nothing here holds them while ``run`` may free them
    (a step that zeroes its gradients to None)."""
    tensors = list(static())
    start = storage_bytes(tensors)
    recorder = memory_recorder(device or torch.device("cpu"), tensors)
    del tensors
    with recorder:
        recorder.on_mark("start")
        out = run()
        recorder.on_mark("end")
    return out, peak_from(recorder.marks(), start), getattr(recorder, "figures", None)


_MARK, _ALLOC, _FREE, _GONE = range(4)
Event = tuple[int, int, int, int, str, int]  # (time, kind, address, bytes, label, end of its c10d op)


def _cpu_events(prof: Any, *, inputs: bool) -> tuple[list[Event], dict[int, list[tuple[int, int]]]]:
    """Each mark, CPU allocation, free (as the allocator reported it) and static block's end, in
    time order (at one time: as the events came); an allocation made inside a collective (a
    ``c10d::`` or ``_c10d_functional::`` op) carries the op's end time. With ``inputs`` (the
    recording kept them: ``record_shapes``, in a process group), each block's uses too: the
    (start, end) of every op that took a tensor on it as an input."""
    out: list[Event] = []
    uses: dict[int, list[tuple[int, int]]] = {}
    stack = [(e, 0) for e in reversed(prof.profiler.kineto_results.experimental_event_tree())]
    while stack:  # depth first, in the tree's order
        e, c10d_end = stack.pop()
        if not c10d_end and e.name.startswith(("c10d::", "_c10d_functional::")):
            c10d_end = e.end_time_ns
        stack.extend((c, c10d_end) for c in reversed(e.children))
        f = e.extra_fields
        if isinstance(f, ProfiledAllocation):
            if f.device.type == "cpu":
                alloc = f.alloc_size > 0
                out.append((e.start_time_ns, _ALLOC if alloc else _FREE, f.ptr, f.alloc_size, "",
                            c10d_end if alloc else 0))
        elif e.name.startswith("memfit:"):
            out.append((e.start_time_ns, _MARK, 0, 0, e.name[7:], 0))
        elif e.name.startswith("memfit-gone:"):
            out.append((e.start_time_ns, _GONE, int(e.name[12:]), 0, "", 0))
        elif inputs and isinstance(f, ProfiledOp):
            for ptr in _input_blocks(f.inputs):
                uses.setdefault(ptr, []).append((e.start_time_ns, e.end_time_ns))
    out.sort(key=lambda x: x[0])
    return out, uses


def _live_blocks() -> set[int]:
    """The storage addresses of the CPU tensors Python can reach now, and of their gradients (a
    wrapper subclass's, such as a DTensor's: its inner tensors')."""
    out: set[int] = set()
    for o in gc.get_objects():
        if not issubclass(type(o), torch.Tensor):  # isinstance asks some proxies, which warn
            continue
        for t in (o, o.grad if o.is_leaf else None):  # a non-leaf's .grad warns
            for inner in () if t is None else inner_tensors(t):
                if inner.device.type == "cpu" and not is_fake(inner) and inner.layout == torch.strided:
                    out.add(inner.untyped_storage().data_ptr())
    return out


def _input_blocks(inputs: Iterable[Any]) -> set[int]:
    """The storage addresses of the tensors among an op's recorded inputs (lists searched too)."""
    out: set[int] = set()
    for x in inputs:
        if isinstance(x, list):
            out |= _input_blocks(x)
        elif getattr(x, "storage_data_ptr", None):
            out.add(x.storage_data_ptr)
    return out


def _with_unseen_frees(events: list[Event], uses: dict[int, list[tuple[int, int]]],
                       live: set[int]) -> list[Event]:
    """``events`` with a free of each block whose free went unheard (see ``CpuMemoryRecorder``):
    at the end of the last op that used it, or made it inside a collective, before a new block
    took its address (``uses``: ``_cpu_events``; with neither, the recorder drops it there); a block
    never heard to go that was used, or made inside a collective, went then too unless ``live``
    (``_live_blocks``: the tensors alive at the end) names it."""
    made: dict[int, tuple[int, int, int]] = {}  # address -> (bytes, made at, end of its c10d op)
    unseen: list[Event] = []

    def gone(ptr: int, block: tuple[int, int, int], until: int) -> None:
        nbytes, start, op_end = block
        last = max([op_end, *(end for s, end in uses.get(ptr, ()) if start <= s < until)])
        if 0 < last <= until:
            unseen.append((last, _FREE, ptr, -nbytes, "", 0))

    for time, kind, ptr, nbytes, _, op_end in events:
        if kind == _ALLOC:
            old = made.pop(ptr, None)
            if old is not None:
                gone(ptr, old, time)
            made[ptr] = (nbytes, time, op_end)
        elif kind == _FREE:
            made.pop(ptr, None)
    for ptr, block in made.items():
        if ptr not in live and (block[2] or ptr in uses):  # never seen to go, and not alive
            gone(ptr, block, sys.maxsize)
    if not unseen:
        return events
    return sorted(events + unseen, key=lambda x: x[0])


class CudaFigures(TypedDict):
    """What the card itself said about a measured step, beside the allocated bytes memfit plans:
    the allocator's reserved peak, and ``torch.cuda.mem_get_info`` at the step's end."""

    total_bytes: int
    free_bytes: int  # at the step's end
    reserved_bytes: int  # at the step's end: with free_bytes, what lies outside the allocator
    reserved_peak_bytes: int  # over the step


class CudaMemoryRecorder:
    """Live bytes from the CUDA caching allocator's statistics (allocated, not reserved), and
    the reserved peak and free memory of the whole stretch (``figures``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = 0
        self._marks: list[Mark] = []
        self._reserved_peak = 0
        self.figures: CudaFigures | None = None

    def __enter__(self) -> CudaMemoryRecorder:
        self._gc = gc_held()
        self._gc.__enter__()
        torch.cuda.synchronize(self.device)
        self._start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            torch.cuda.synchronize(self.device)
            self._reserved_peak = max(self._reserved_peak, torch.cuda.max_memory_reserved(self.device))
            free, total = torch.cuda.mem_get_info(self.device)
            self.figures = CudaFigures(total_bytes=int(total), free_bytes=int(free),
                                       reserved_bytes=torch.cuda.memory_reserved(self.device),
                                       reserved_peak_bytes=self._reserved_peak)
        finally:
            self._gc.__exit__(*exc)

    def on_mark(self, label: str) -> None:
        level = torch.cuda.memory_allocated(self.device) - self._start
        peak = torch.cuda.max_memory_allocated(self.device) - self._start
        self._marks.append(Mark(label, level, peak))
        self._reserved_peak = max(self._reserved_peak, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def marks(self) -> list[Mark]:
        return self._marks


_NOISE = ("USDT:", "profiler_start", "profiler_stop", "Memory block of unknown size")


@contextmanager
def _filtered_stderr() -> Iterator[None]:
    """Drop the profiler's own start/stop chatter (written by C++ straight to file descriptor 2)
    and pass every other line through."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (captured): nothing to filter
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if line.strip() and not any(n in line for n in _NOISE):
                    sys.stderr.write(line)


def device_memory(device: torch.device) -> MemoryRecord | None:
    """What this GPU leaves to a step (devices.py): its total as CUDA reports it, and the context
    and margin of the table's entry for its name (the defaults for a card not in the table); None
    on the CPU. The measured context and margin come from ``memfit validate`` on the card."""
    from memfit.devices import CONTEXT_BYTES, MARGIN, by_title

    if device.type != "cuda":
        return None
    title = torch.cuda.get_device_name(device)
    known = by_title(title)
    return MemoryRecord(title=title, total_bytes=int(torch.cuda.mem_get_info(device)[1]),
                        context_bytes=known.context_bytes if known else CONTEXT_BYTES,
                        margin=known.margin if known else MARGIN,
                        source="total: torch.cuda.mem_get_info on this GPU; context and margin: "
                               + (f"{known.name}'s ({known.source})" if known else "memfit's defaults"))


def memory_recorder(device: torch.device, alive: Iterable[torch.Tensor] = ()) -> CpuMemoryRecorder | CudaMemoryRecorder:
    """The device's meter; ``alive``: the tensors counted in the level a step starts from, whose
    frees during it count (the CUDA allocator sees every free without being told)."""
    if device.type == "cuda":
        return CudaMemoryRecorder(device)
    if device.type == "cpu":
        return CpuMemoryRecorder(alive)
    raise MemfitError(f"memfit measures memory on CPU and CUDA devices, not {device.type!r}")
