"""What a region's recomputation must see as its forward saw it: the parameters a call substituted
(``torch.func.functional_call`` with fast weights) and BatchNorm's running statistics, which a
recomputation in training mode would update a second time (held still, or put back)."""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
from torch import nn

from memfit.torch_private import BatchNorm


class Tables:
    """A unit's modules' parameter tables, and (weakly, so that a parameter the user replaced is
    not kept) the parameters last seen in them, all of them ``nn.Parameter``: while the tables
    hold the same objects, no call substituted any."""

    __slots__ = ("seen", "tables")

    def __init__(self, tables: list[dict[str, Any]]) -> None:
        self.tables = tables
        self.seen: list[weakref.ref[Any]] = []

    def current(self) -> list[Any]:
        return [p for table in self.tables for p in table.values() if p is not None]

    def same(self, now: list[Any]) -> bool:
        return len(now) == len(self.seen) and all(map(operator.is_, now, map(_deref, self.seen)))

    def remember(self, now: list[Any]) -> None:
        self.seen = [weakref.ref(p) for p in now]


_deref = weakref.ref.__call__


def substituted(module: nn.Module, tables: Tables) -> dict[str, torch.Tensor] | None:
    """The unit's parameters and buffers as this call sees them, when any parameter is not the
    module's own (``torch.func.functional_call`` puts plain tensors in ``_parameters``); None
    otherwise, the usual case, which costs one comparison of the tables' objects with the last
    ones seen (identity first: a per-parameter type check cost a launch-bound step a point)."""
    now = tables.current()
    if tables.same(now):
        return None
    # type() first: isinstance against Parameter's metaclass is a Python call per parameter
    if all(type(p) is nn.Parameter or isinstance(p, nn.Parameter) for p in now):
        tables.remember(now)
        return None
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


class PutBack:
    """Around a recomputation: the BatchNorm statistics that it would update a second time in
    training mode left as they were when it began (not as after the forward: a second forward of
    the model before this backward has updated them since). Layers that run ``_BatchNorm``'s own
    forward (BatchNorm1d/2d/3d) are held still for its duration with no tensor op: momentum 0
    (the kernel's running = 0 * batch + 1 * running leaves every finite value as it was) and no
    ``num_batches_tracked`` to count; the batch statistics normalize as in the forward. Others
    (SyncBatchNorm, subclasses with a forward of their own) get their buffers copied back after."""

    def __init__(self, norms: list[nn.Module], inner: Any) -> None:
        self.norms = norms
        self.inner = inner
        self.held: list[tuple[nn.Module, Any, Any]] = []
        self.stats: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        for m in self.norms:
            if not (m.training and m.track_running_stats):
                continue
            if type(m).forward is _BATCH_NORM_FORWARD:  # plain attributes: no Module.__setattr__ per layer
                buffers = m._buffers
                self.held.append((m, m.momentum, buffers.get("num_batches_tracked")))
                m.__dict__["momentum"] = 0.0
                if "num_batches_tracked" in buffers:
                    buffers["num_batches_tracked"] = None
            else:
                self.stats += [(b, b.clone()) for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                               if b is not None]
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            for m, momentum, tracked in self.held:
                m.__dict__["momentum"] = momentum
                if tracked is not None:
                    m._buffers["num_batches_tracked"] = tracked
            with torch.no_grad():
                for buffer, value in self.stats:
                    buffer.copy_(value)
            self.held, self.stats = [], []


_BATCH_NORM_FORWARD = getattr(BatchNorm, "forward", None)  # a stand-in class has none (torch_private)
