"""Running the step with marks, and turning marks into the phases of a Profile."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.measure.memory import Mark
from memfit.measure.meters import Meters
from memfit.measure.step import Inputs, LossFn, training_step, zero_grad
from memfit.profiler.marks import UnitMarks


@dataclass(slots=True)
class Stretch:
    """The step between two consecutive marks, named by the first."""

    label: str
    peak: int  # above the level at the first mark
    end: int  # level change to the second mark
    seconds: float


def recorded_step(
    model: nn.Module,
    unit_names: list[str],
    inputs: Inputs,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    meters: Meters,
    what: str,
) -> list[Mark]:
    """One training step with marks; ``what`` is ``memory`` or ``time``."""
    zero_grad(model, optimizer)
    recorder = meters.memory() if what == "memory" else meters.clock()
    with recorder, UnitMarks(model, unit_names, recorder.on_mark):
        training_step(model, inputs, loss_fn, optimizer, on_mark=recorder.on_mark)
    return recorder.marks()


def stretches(marks: list[Mark]) -> list[Stretch]:
    if not marks or marks[0].label != "forward" or marks[-1].label != "done":
        raise MemfitError("the profiled step was not recorded whole (marks are missing)")
    out = []
    for a, b in itertools.pairwise(marks):
        out.append(Stretch(a.label, b.peak - a.level, b.level - a.level, b.time_s - a.time_s))
    return out


def check_same_shape(reference: list[Stretch], other: list[Stretch], what: str) -> None:
    ref = [s.label for s in reference]
    got = [s.label for s in other]
    if ref != got:
        raise MemfitError(
            f"the step ran its units in another order when {what}: {ref} vs {got}; memfit needs "
            "units that run once each, in one order, forward and backward"
        )
