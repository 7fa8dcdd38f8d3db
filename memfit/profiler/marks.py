"""Marks at unit boundaries, and recorders that read memory or time at each mark.

A mark is a label heard at a moment of the step: ``fwd:i`` / ``fwd_end:i`` around unit i's
forward (module hooks), ``bwd:i`` when the gradient of its output arrives and ``bwd_end:i`` when
the gradient of its input is complete (tensor hooks), plus the step's own ``forward``,
``backward``, ``step`` and ``done``. Consecutive marks bound the phases of the Profile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from memfit.errors import MemfitError
from memfit.measure.step import iter_tensors
from memfit.runtime.regions import recomputing


class UnitMarks:
    """Context manager: hooks on the units that report boundary marks to ``on_mark``."""

    def __init__(self, model: nn.Module, unit_names: list[str], on_mark: Callable[[str], None]):
        self.units = [model.get_submodule(n) for n in unit_names]
        self.names = unit_names
        self.on_mark = on_mark
        self._handles: list[Any] = []
        self._labels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._seen: set[int] = set()

    def __enter__(self) -> UnitMarks:
        for i, unit in enumerate(self.units):  # marks outside a checkpointed region's own hooks
            self._handles.append(unit.register_forward_pre_hook(self._pre(i), with_kwargs=True, prepend=True))
            self._handles.append(unit.register_forward_hook(self._post(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if recomputing():  # a checkpointed unit run again in the backward: not a new forward
                return
            if i in self._seen:
                raise MemfitError(
                    f"unit {self.names[i]!r} ran twice in one forward; units must each run once "
                    "per step (choose other units with --units, or units=[...] in Python)"
                )
            self._seen.add(i)
            self.on_mark(f"fwd:{i}")
            self._tag((args, kwargs), f"bwd_end:{i}")

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if recomputing():
                return
            self.on_mark(f"fwd_end:{i}")
            self._tag(output, f"bwd:{i}")

        return hook

    def _tag(self, obj: Any, label: str) -> None:
        tensor = next((t for t in iter_tensors(obj) if t.requires_grad), None)
        if tensor is None:
            return
        labels = self._labels.get(tensor)
        if labels is None:
            labels = []
            self._labels[tensor] = labels
            self._handles.append(tensor.register_hook(lambda grad, ls=labels: self._fire(ls)))
        labels.append(label)

    def _fire(self, labels: list[str]) -> None:
        # One tensor can end one unit's backward and begin the previous one's: ends come first.
        for label in sorted(labels, key=lambda s: s.startswith("bwd:")):
            self.on_mark(label)
