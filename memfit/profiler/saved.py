"""Bytes each unit keeps for backward and takes as input, attributed to the unit that made them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from memfit.profiler.marks import UnitMarks
from memfit.profiler.step import Inputs, LossFn, iter_tensors


class _Producers(TorchDispatchMode):
    """Remembers which unit's forward created each storage (the first op that returned it)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: int | None = None
        self.owner: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in iter_tensors(out):
            st = t.untyped_storage()
            if st not in self.owner:
                self.owner[st] = self.current
        return out


def saved_and_input_bytes(
    model: nn.Module, unit_names: list[str], inputs: Inputs, loss_fn: LossFn
) -> tuple[list[int], list[int]]:
    """Per unit: bytes packed for backward (deduplicated by storage, parameters and buffers
    excluded, counted for the unit that produced them) and bytes of its tensor inputs."""
    n = len(unit_names)
    known = WeakIdKeyDictionary()  # storages that exist before the step: parameters, buffers, inputs
    for t in [*model.parameters(), *model.buffers(), *inputs.tensors()]:
        known[t.untyped_storage()] = True
    producers = _Producers()
    seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
    input_bytes = [0] * n
    saved_bytes = [0] * n

    def on_mark(label: str) -> None:
        kind, _, idx = label.partition(":")
        if kind == "fwd":
            producers.current = int(idx)
        elif kind == "fwd_end":
            producers.current = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st not in known and st not in seen:
            seen[st] = True
            owner = producers.owner.get(st)
            if owner is not None:
                saved_bytes[owner] += st.nbytes()
        return t

    marks = UnitMarks(model, unit_names, on_mark)
    units = marks.units
    handles = [
        u.register_forward_pre_hook(_input_counter(i, input_bytes, model), with_kwargs=True)
        for i, u in enumerate(units)
    ]
    try:
        with marks, producers, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(*inputs.args, **inputs.kwargs))
        del loss
    finally:
        for h in handles:
            h.remove()
    return saved_bytes, input_bytes


def _input_counter(i: int, out: list[int], model: nn.Module) -> Callable[..., None]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen: set[int] = set()
        for t in iter_tensors((args, kwargs)):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                out[i] += t.untyped_storage().nbytes()

    return hook
