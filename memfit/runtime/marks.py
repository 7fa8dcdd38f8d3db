"""Marks at unit boundaries, the step run with them, and the stretches between marks.

A mark is a label heard at a moment of the step: ``fwd:i`` / ``fwd_end:i`` around unit i's
forward (module hooks), ``bwd:i`` when the gradient of its output arrives and ``bwd_end:i`` when
the gradient of its input is complete (tensor hooks), plus the step's own ``forward``,
``backward``, ``clip``, ``step`` and ``done``. A unit's later runs in one step (a second
micro-batch, a user step with two forwards) carry their run: ``fwd:i@2``, ``bwd:i@2``.
Consecutive marks bound the phases of the Profile.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from memfit.errors import MemfitError
from memfit.measure.inputs import Inputs, iter_tensors
from memfit.measure.memory import Mark
from memfit.measure.meters import Meters, Recorder, Together
from memfit.measure.step import LossFn, StepState, static_tensors, training_step
from memfit.measure.userstep import UserStepState
from memfit.runtime.threads import recomputing


class UnitMarks:
    """Context manager: hooks on the units that report boundary marks to ``on_mark``."""

    def __init__(self, model: nn.Module, unit_names: list[str], on_mark: Callable[[str], None], *,
                 once: bool = True):
        self.units = [model.get_submodule(n) for n in unit_names]
        self.names = unit_names
        self.on_mark = on_mark
        self.once = once  # each unit runs once per forward (memfit's own step); a user's step may run it more
        self._handles: list[Any] = []
        self._labels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._seen: set[int] = set()
        self._runs = [0] * len(unit_names)

    def step_mark(self, label: str) -> None:
        """The step's own marks: a new micro-batch's ``forward`` lets every unit run once more."""
        if label.startswith("forward"):
            self._seen.clear()
        self.on_mark(label)

    @property
    def runs(self) -> list[int]:
        """How many times each unit has run so far."""
        return list(self._runs)

    def _run_label(self, i: int) -> str:
        return f"{i}@{self._runs[i]}" if self._runs[i] > 1 else str(i)

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
            if self.once and i in self._seen:
                raise MemfitError(
                    f"unit {self.names[i]!r} ran twice in one forward; units must each run once "
                    "per step (choose other units with --units, or units=[...] in Python)"
                )
            self._seen.add(i)
            self._runs[i] += 1
            self.on_mark(f"fwd:{self._run_label(i)}")
            self._tag((args, kwargs), f"bwd_end:{self._run_label(i)}")

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if recomputing():
                return
            self.on_mark(f"fwd_end:{self._run_label(i)}")
            self._tag(output, f"bwd:{self._run_label(i)}")

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


@dataclass(slots=True)
class Stretch:
    """The step between two consecutive marks, named by the first."""

    label: str
    peak: int  # above the level at the first mark
    end: int  # level change to the second mark
    seconds: float
    work_s: float = 0.0  # of ``seconds``, the options' own work (``measure/host.Work``; a real CPU clock's)


def recorded_step(
    model: nn.Module,
    unit_names: list[str],
    inputs: Inputs,
    loss_fn: LossFn,
    state: StepState | UserStepState,
    meters: Meters,
    what: str,
) -> list[Mark]:
    """One training step with marks, of two micro-batches at most (every later one repeats the
    second); ``what`` is ``memory``, ``time`` or, for meters that allow it (``Meters.together``),
    ``both``."""
    state.zero_grad()
    if what == "time":
        recorder: Recorder = meters.clock()
    else:
        recorder = meters.memory(static_tensors(model, state, inputs))
        if what == "both":
            if not meters.together:
                raise ValueError("these meters disturb each other: read memory and time in steps of their own")
            recorder = Together(recorder, meters.clock())
    with recorder, UnitMarks(model, unit_names, recorder.on_mark, once=state.units_once) as marks:
        training_step(model, inputs, loss_fn, state, on_mark=marks.step_mark, micro_batches=2)
    return recorder.marks()


def stretches(marks: list[Mark]) -> list[Stretch]:
    if not marks or marks[0].label != "forward" or marks[-1].label != "done":
        raise MemfitError("the profiled step was not recorded whole (marks are missing)")
    out = []
    for a, b in itertools.pairwise(marks):
        out.append(Stretch(a.label, b.peak - a.level, b.level - a.level, b.time_s - a.time_s,
                           b.work_s - a.work_s))
    return out


def check_same_shape(reference: list[Stretch], other: list[Stretch], what: str) -> None:
    ref = [s.label for s in reference]
    got = [s.label for s in other]
    if ref != got:
        raise MemfitError(
            f"the step ran its units in another order when {what}: {ref} vs {got}; memfit needs "
            "units that run once each, in one order, forward and backward"
        )
