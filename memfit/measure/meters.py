"""The meters a training step is measured with, behind one small interface: a recorder that notes
live bytes or time at each mark. Real ones (memory.py on the CPU and CUDA, ``TimeRecorder``) or
estimate mode's fake ones (fake.py); the profiler is handed a ``Meters`` and does not ask which."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from memfit.measure import host
from memfit.measure.memory import Mark, memory_recorder
from memfit.measure.timing import clock


class Recorder(Protocol):
    """Notes a ``Mark`` at each ``on_mark`` while entered."""

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...
    def on_mark(self, label: str) -> None: ...
    def marks(self) -> list[Mark]: ...


@dataclass(frozen=True, slots=True)
class Meters:
    """A fresh memory recorder and a fresh clock for each measured step; the memory recorder is
    given the tensors counted in the level the step starts from (their frees during it count)."""

    memory: Callable[[Iterable[torch.Tensor]], Recorder]
    clock: Callable[[], Recorder]
    byte_masks: bool = False  # the target keeps dropout's masks at one byte per element (CUDA, estimated)
    together: bool = False  # one step may be read by both (``Together``): neither disturbs the other


class Together:
    """A memory recorder and a clock in one step, their marks merged: live bytes from the one,
    time from the other. Only for meters that do not disturb each other (``Meters.together``:
    estimate mode's, whose clock is a roofline over the ops, not the time the count takes)."""

    def __init__(self, memory: Recorder, clock: Recorder) -> None:
        self.memory, self.clock = memory, clock

    def __enter__(self) -> Together:
        self.memory.__enter__()
        try:
            self.clock.__enter__()
        except BaseException:
            self.memory.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.clock.__exit__(*exc)
        finally:
            self.memory.__exit__(*exc)

    def on_mark(self, label: str) -> None:
        self.memory.on_mark(label)
        self.clock.on_mark(label)

    def marks(self) -> list[Mark]:
        return [Mark(m.label, m.level, m.peak, t.time_s, t.work_s)
                for m, t in zip(self.memory.marks(), self.clock.marks(), strict=True)]


def real_meters(device: torch.device) -> Meters:
    """The device's own: exact live bytes (memory.py) and the wall clock."""
    return Meters(lambda alive: memory_recorder(device, alive), lambda: TimeRecorder(device))


class TimeRecorder:
    """The time at each mark. On the CPU by ``timing.clock`` (one thread: its CPU time; else the
    wall). On CUDA by events on the current stream, read once after the step: a synchronisation
    at every mark would serialise the host and the device, so the stretches and the whole step
    would be priced as a real step never runs (launch-bound steps measured 2 to 4 times their
    prediction on an H200 that way, docs/cuda.md), and the host's launches would hide behind the
    waits. On the CPU it also notes the seconds of the options' own work so far (``host.Work``):
    on CUDA the host's time there is not its kernels' time, so none is noted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._now = clock(device)
        self._marks: list[Mark] = []
        self._events: list[tuple[str, Any]] = []

    def __enter__(self) -> TimeRecorder:
        if self.device.type != "cuda":
            host.counting_work(True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type != "cuda":
            host.counting_work(False)

    def on_mark(self, label: str) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events.append((label, event))
        else:
            self._marks.append(Mark(label, 0, 0, self._now(), host.work_seconds()))

    def marks(self) -> list[Mark]:
        if self._events:
            torch.cuda.synchronize(self.device)
            first = self._events[0][1]
            self._marks = [Mark(label, 0, 0, first.elapsed_time(e) / 1e3) for label, e in self._events]
            self._events = []
        return self._marks
