"""Peak-memory meters: exact live-tensor bytes on the CPU, allocator statistics on CUDA.

Both report marks: the live bytes at a labelled moment and the highest live bytes since the
previous mark, relative to where the meter started. The profiler marks unit boundaries; a
plain measurement marks only the start and the end.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from memfit.devices import MemoryRecord
from memfit.errors import MemfitError


@dataclass(slots=True)
class Mark:
    label: str
    level: int  # live bytes at the mark, relative to the step's start
    peak: int  # highest live bytes since the previous mark, relative to the step's start
    time_s: float = 0.0


class CpuMemoryRecorder:
    """Exact live bytes on the CPU from the allocator's own events (the CPU allocator does not
    cache). Relies on ``prof.profiler.kineto_results.events()``, a private but long-stable
    surface, because the public ``prof.events()`` does not carry every allocation."""

    def __init__(self) -> None:
        self._prof: Any = None

    def __enter__(self) -> CpuMemoryRecorder:
        self._quiet = _filtered_stderr()
        self._quiet.__enter__()
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def on_mark(self, label: str) -> None:
        with torch.profiler.record_function(f"memfit:{label}"):
            pass

    def marks(self) -> list[Mark]:
        events = list(self._prof.profiler.kineto_results.events())
        cpu = torch.autograd.DeviceType.CPU
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == cpu)
        labels = sorted((e.start_ns(), e.name()[7:]) for e in events if e.name().startswith("memfit:"))
        out: list[Mark] = []
        level = peak = 0
        j = 0
        for t, label in labels:
            while j < len(memory) and memory[j][0] < t:
                level += memory[j][1]
                peak = max(peak, level)
                j += 1
            out.append(Mark(label, level, peak))
            peak = level
        return out


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
        torch.cuda.synchronize(self.device)
        self._start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self._reserved_peak = max(self._reserved_peak, torch.cuda.max_memory_reserved(self.device))
        free, total = torch.cuda.mem_get_info(self.device)
        self.figures = CudaFigures(total_bytes=int(total), free_bytes=int(free),
                                   reserved_bytes=torch.cuda.memory_reserved(self.device),
                                   reserved_peak_bytes=self._reserved_peak)

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


def device_memory(device: torch.device) -> MemoryRecord | dict[str, Any]:
    """What this GPU leaves to a step (devices.py): its total as CUDA reports it, and the context
    and margin of the table's entry for its name (the defaults for a card not in the table); {}
    on the CPU. The measured context and margin come from ``memfit validate`` on the card."""
    from memfit.devices import CONTEXT_BYTES, MARGIN, by_title

    if device.type != "cuda":
        return {}
    title = torch.cuda.get_device_name(device)
    known = by_title(title)
    return MemoryRecord(title=title, total_bytes=int(torch.cuda.mem_get_info(device)[1]),
                        context_bytes=known.context_bytes if known else CONTEXT_BYTES,
                        margin=known.margin if known else MARGIN,
                        source="total: torch.cuda.mem_get_info on this GPU; context and margin: "
                               + (f"{known.name}'s ({known.source})" if known else "memfit's defaults"))


def memory_recorder(device: torch.device) -> CpuMemoryRecorder | CudaMemoryRecorder:
    if device.type == "cuda":
        return CudaMemoryRecorder(device)
    if device.type == "cpu":
        return CpuMemoryRecorder()
    raise MemfitError(f"memfit measures memory on CPU and CUDA devices, not {device.type!r}")
