"""Bytes each unit keeps for backward and takes as input, attributed to the unit that made them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from memfit.errors import UnitSelectionError
from memfit.measure.inputs import Inputs, iter_tensors
from memfit.measure.step import LossFn, local, packed, storage_bytes, storage_key
from memfit.runtime.marks import UnitMarks
from memfit.torch_private import TorchDispatchMode


class _Producers(TorchDispatchMode):
    """Remembers which unit's forward created each storage (the first op that returned it),
    which storages are casts of parameters (autocast's, which its cache holds to the forward's
    end), and with ``byte_masks`` which hold dropout's mask (``bernoulli_``), which a CUDA target
    keeps as one byte per element (fake CPU tensors make it in the input's dtype)."""

    def __init__(self, params: set[int], byte_masks: bool = False) -> None:
        super().__init__()
        self.current: int | None = None
        self.owner: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.casts: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> True
        self.masks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> True
        self._params = params
        self._byte_masks = byte_masks

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in iter_tensors(out):
            st = t.untyped_storage()
            if st not in self.owner:
                self.owner[st] = self.current
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and isinstance(
                out, torch.Tensor) and storage_key(local(args[0]).untyped_storage()) in self._params:
            self.casts[out.untyped_storage()] = True
        if self._byte_masks and func is torch.ops.aten.bernoulli_.float:
            self.masks[args[0].untyped_storage()] = True
        return out


@dataclass(slots=True)
class UnitFacts:
    saved: list[int]  # bytes packed for backward, by the unit that produced them
    inputs: list[int]  # bytes of each unit's tensor inputs
    outputs: list[int]  # bytes of each unit's tensor outputs
    chain: bool  # each unit's single tensor output is the next unit's only positional input
    keeps_output: list[bool]  # the unit saves its own output for backward and the next unit takes it
    saved_casts: list[int]  # bytes of parameter casts (autocast's) the unit saves for backward
    # the unit saves its own output for backward and the next unit does not take it: checkpointed,
    # the model's own code may drop it right after the unit (``x = x + block(x)``)
    may_free_output: list[bool]


def unit_facts(model: nn.Module, unit_names: list[str], inputs: Inputs, loss_fn: LossFn,
               run: Callable[[Callable[[str], None]], Any] | None = None, byte_masks: bool = False) -> UnitFacts:
    """One forward pass, watched: bytes packed for backward (deduplicated by storage, parameters
    and buffers excluded, counted for the unit that produced them), bytes in and out of each
    unit, and whether the units form a chain that segments can checkpoint as one region.
    ``run(on_mark)``: a user's whole step in place of the forward, of which each unit's first
    run counts (a unit that runs twice is no chain). ``byte_masks``: dropout's masks counted at one
    byte per element, as a CUDA target keeps them (estimate mode)."""
    n = len(unit_names)
    known = WeakIdKeyDictionary()  # storages that exist before the step: parameters, buffers, inputs
    for t in [*model.parameters(), *model.buffers(), *inputs.tensors()]:
        known[local(t).untyped_storage()] = True
    producers = _Producers({storage_key(local(p).untyped_storage()) for p in model.parameters()}, byte_masks)
    saved_casts = [0] * n
    seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
    input_bytes = [0] * n
    saved_bytes = [0] * n

    def on_mark(label: str) -> None:
        kind, _, idx = label.partition(":")
        if kind == "fwd" and "@" in idx:  # a later run: its tensors are the first run's again
            producers.current = None
        elif kind == "fwd":
            producers.current = int(idx)
        elif kind == "fwd_end":
            producers.current = None

    packed_by: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> units that saved it

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if producers.current is not None:
            packed_by.setdefault(st, set()).add(producers.current)
        if st not in known and st not in seen:
            seen[st] = True
            owner = producers.owner.get(st)
            if owner is not None:
                saved_bytes[owner] += st.nbytes() // t.element_size() if st in producers.masks else st.nbytes()
                if st in producers.casts:
                    saved_casts[owner] += st.nbytes()
        return packed(t)

    marks = UnitMarks(model, unit_names, on_mark, once=run is None)
    units = marks.units
    calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
    handles = [
        u.register_forward_pre_hook(_input_counter(i, input_bytes, model), with_kwargs=True)
        for i, u in enumerate(units)
    ]
    first: set[int] = set()
    versions: dict[int, list[tuple[torch.Tensor, int]]] = {}  # a unit's tensor inputs as it was called
    returned: tuple[torch.Tensor, int] | None = None  # the last unit's output and its version as it returned
    changed_between = False  # a unit's output changed in place before the next unit took it

    def before(i: int) -> Callable[..., None]:
        def hook(m: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
            nonlocal changed_between
            if i not in first:
                versions[i] = [(t, t._version) for t in iter_tensors((a, k))]
                if returned is not None and a and a[0] is returned[0] and returned[0]._version != returned[1]:
                    changed_between = True
        return hook

    def called(i: int) -> Callable[..., None]:
        def hook(m: nn.Module, a: tuple[Any, ...], k: dict[str, Any], out: Any) -> None:
            nonlocal returned
            if i not in first:
                first.add(i)
                calls.append((a, k, out))
                returned = (out, out._version) if isinstance(out, torch.Tensor) else None
                if any(t._version != v for t, v in versions.pop(i, [])):
                    raise _changes_input(unit_names[i], m)
        return hook

    handles += [u.register_forward_pre_hook(before(i), with_kwargs=True) for i, u in enumerate(units)]
    handles += [u.register_forward_hook(called(i), with_kwargs=True) for i, u in enumerate(units)]
    try:
        with marks, producers, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if run is None:
                loss = loss_fn(model(*inputs.args, **inputs.kwargs))
                del loss
            else:
                run(marks.step_mark)
        outputs = [storage_bytes(list(iter_tensors(out))) for _, _, out in calls]
        # an op between two units that changes the first one's output in place (a ReLU(inplace=True)
        # between named units) is no member of a segment, whose recomputation would leave it out
        chain = (len(calls) == n and _is_chain(calls) and not changed_between
                 and (run is None or all(c == 1 for c in marks.runs)))
        keeps, frees = [False] * n, [False] * n
        for j in range(min(n, len(calls))):
            out = next(iter_tensors(calls[j][2]), None)
            taken = {t.untyped_storage() for t in iter_tensors((calls[j + 1][0], calls[j + 1][1]))} if (
                j + 1 < len(calls)) else set()
            saves = out is not None and j in packed_by.get(out.untyped_storage(), set())
            keeps[j] = saves and out.untyped_storage() in taken  # type: ignore[union-attr]
            frees[j] = saves and not keeps[j]
        calls.clear()
    finally:
        for h in handles:
            h.remove()
    return UnitFacts(saved_bytes, input_bytes, outputs, chain, keeps, saved_casts, frees)


def _changes_input(name: str, module: nn.Module) -> UnitSelectionError:
    return UnitSelectionError(
        f"unit {name!r} ({type(module).__name__}) changes its input in place (an in-place op such as "
        "nn.ReLU(inplace=True) on the tensor it was called with): a checkpoint keeps that input to run the "
        "unit again in the backward, and it would find it changed. Name units around it instead (with "
        "--units / units=, a module that contains it, or leave it out), or make the op out of place")


def _is_chain(calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]]) -> bool:
    first_kwargs = calls[0][1]
    for j, (args, kwargs, out) in enumerate(calls):
        if not isinstance(out, torch.Tensor) or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return False
        if kwargs.keys() != first_kwargs.keys() or any(kwargs[k] is not first_kwargs[k] for k in kwargs):
            return False
        if j > 0 and args[0] is not calls[j - 1][2]:
            return False
    return True


def _input_counter(i: int, out: list[int], model: nn.Module) -> Callable[..., None]:
    params = {storage_key(local(p).untyped_storage()) for p in model.parameters()}
    counted: list[bool] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if counted:  # a unit's first run only
            return
        counted.append(True)
        seen: set[int] = set()
        for t in iter_tensors((args, kwargs)):
            key = storage_key(t.untyped_storage())
            if key not in params and key not in seen:
                seen.add(key)
                out[i] += t.untyped_storage().nbytes()

    return hook
