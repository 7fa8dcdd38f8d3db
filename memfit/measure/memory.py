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
from typing import Any

import torch

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


class CudaMemoryRecorder:
    """Live bytes from the CUDA caching allocator's statistics (allocated, not reserved)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = 0
        self._marks: list[Mark] = []

    def __enter__(self) -> CudaMemoryRecorder:
        torch.cuda.synchronize(self.device)
        self._start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)

    def on_mark(self, label: str) -> None:
        level = torch.cuda.memory_allocated(self.device) - self._start
        peak = torch.cuda.max_memory_allocated(self.device) - self._start
        self._marks.append(Mark(label, level, peak))
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


def memory_recorder(device: torch.device) -> CpuMemoryRecorder | CudaMemoryRecorder:
    if device.type == "cuda":
        return CudaMemoryRecorder(device)
    if device.type == "cpu":
        return CpuMemoryRecorder()
    raise MemfitError(f"memfit measures memory on CPU and CUDA devices, not {device.type!r}")
