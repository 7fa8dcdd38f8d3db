"""What the runtime tells the clocks, which they cannot see from below.

- For estimate mode's clock, host work per op: whether this thread's ops pass through a Python
  dispatch mode above the clock (selective checkpointing's two modes: the caching one in a
  region's forward, the cached one in its recomputation). A mode lower on the stack never sees
  the modes above it (PyTorch pops each while it handles an op), so the runtime says so around
  the contexts it opens.
- For a real CPU clock, the time of the options' own work in a step (``Work``: a region's forward
  run again, a re-derived tensor made, derive's hooks): the profiler prices an option from it,
  where the difference of two whole steps carries the step's noise.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

_thread = threading.local()


def under_dispatch_mode() -> bool:
    """True while this thread runs ops through a Python dispatch mode that memfit opened."""
    return getattr(_thread, "dispatch", 0) > 0


def served_later() -> None:
    """An op whose output the forward's mode keeps: the recomputation's mode will hand it back
    from its cache without running it, so no clock below sees that op; counted now instead."""
    if under_dispatch_mode():
        _thread.served = getattr(_thread, "served", 0) + 1


def take_served() -> int:
    """The ops counted by ``served_later`` since the last call."""
    n = getattr(_thread, "served", 0)
    _thread.served = 0
    return n


class UnderDispatchMode:
    """Wraps a context that pushes a Python dispatch mode (SAC's), so the clock knows it is in force."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        _thread.dispatch = getattr(_thread, "dispatch", 0) + 1
        try:
            return self.inner.__enter__()
        except BaseException:
            _thread.dispatch -= 1
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            _thread.dispatch -= 1


class _Tally:
    """Seconds of the options' own work while a clock counts them (``counting_work``); one for the
    process, since a backward may run on another thread than the step's."""

    __slots__ = ("on", "seconds")

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0


_TALLY = _Tally()


def counting_work(on: bool) -> None:
    """From now on, or no longer, count the time spent in ``Work`` (from zero)."""
    _TALLY.on, _TALLY.seconds = on, 0.0


def work_seconds() -> float:
    """Seconds spent in ``Work`` since counting began (outermost sections only)."""
    return _TALLY.seconds


class Work:
    """Around work that an option adds to a step: a region's forward run again, a re-derived
    tensor's ops, derive's hooks that pack and unpack what autograd saves. Nested sections (a recipe
    whose input is re-derived too, the recipes an unpack hook runs) count once, by the outermost.
    By the wall clock (``perf_counter``, 45 ns a read here, against 230 for the thread's CPU time:
    the sections are short and many, and a section's wait for a core is rare beside a step's); it
    costs 0.2 µs while nothing counts (``timed``: 6 ns, for what runs on every saved tensor)."""

    __slots__ = ("start",)

    def __enter__(self) -> None:
        if not _TALLY.on:
            self.start = None
            return
        depth = getattr(_thread, "work", 0)
        _thread.work = depth + 1
        self.start = time.perf_counter() if depth == 0 else math.nan

    def __exit__(self, *exc: Any) -> None:
        if self.start is None:
            return
        _thread.work -= 1
        if _TALLY.on and not math.isnan(self.start):
            _TALLY.seconds += time.perf_counter() - self.start


def timed(fn: Callable[[Any], Any], arg: Any) -> Any:
    """``fn(arg)`` inside ``Work`` while a clock counts, else straight: for the hooks autograd calls
    on every saved tensor, where a ``Work`` made for nothing (0.2 µs) is a few percent of the hook."""
    if not _TALLY.on:
        return fn(arg)
    with Work():
        return fn(arg)
