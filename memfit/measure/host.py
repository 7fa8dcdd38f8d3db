"""Host work per op that estimate mode's clock prices and cannot see from below: whether this
thread's ops pass through a Python dispatch mode above the clock (selective checkpointing's two
modes: the caching one in a region's forward, the cached one in its recomputation). A mode
lower on the stack never sees the modes above it (PyTorch pops each while it handles an op), so
the runtime says so around the contexts it opens."""

from __future__ import annotations

import threading
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
