"""Per-thread state and weak references that checkpointed regions (runtime/regions.py) and
``derive`` (runtime/derive.py) share: whether this thread is recomputing, objects whose open
contexts belong to one thread's forward, and module references that copies carry over."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from torch import nn

_thread = threading.local()


def recomputing() -> bool:
    """True while this thread recomputes a region's forward (inside the backward pass)."""
    return getattr(_thread, "recomputing", 0) > 0


class Weak:
    """A weak reference to a module that ``copy.deepcopy`` and pickling carry over to the copy's
    module (a ``weakref.ref`` is copied as it is, still pointing at the original). Weak, because
    the modules hold what refers to them (hooks, attributes): a cycle back would leave a dropped
    model to the cyclic collector, whose frees can land inside a measured step."""

    __slots__ = ("ref",)

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def __call__(self) -> nn.Module | None:
        return self.ref()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Weak, (self.ref(),))


class PerThread:
    """A base for objects with per-thread state in ``self._tls``, which copies and pickles leave
    behind: what is open belongs to one forward of one thread, not to the model."""

    def __init__(self) -> None:
        self._tls = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_tls", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tls = threading.local()


class Recomputing:
    """This thread recomputes a region's forward while inside (nested regions count); with
    ``own``, the region's per-thread state, that region in particular (``Region._aside``)."""

    __slots__ = ("own",)

    def __init__(self, own: Any = None) -> None:
        self.own = own

    def __enter__(self) -> None:
        _thread.recomputing = getattr(_thread, "recomputing", 0) + 1
        if self.own is not None:
            self.own.recomputing = getattr(self.own, "recomputing", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _thread.recomputing -= 1
        if self.own is not None:
            self.own.recomputing -= 1


def raising(output: Any) -> bool:
    """An ``always_call`` forward hook is called with no output while the forward raises."""
    return output is None and sys.exc_info()[0] is not None


def opened_regions() -> dict[Any, None]:
    """The checkpointed regions this thread has open, in the order they opened: what a model's
    guard closes, without a look at each of a deep model's regions twice per forward."""
    opened = getattr(_thread, "opened", None)
    if opened is None:
        opened = _thread.opened = {}
    return opened
