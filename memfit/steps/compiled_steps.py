"""Compiled training steps of copies of a model, each compiled once: their peaks and their times,
interleaved (compiled planning's measurements, steps/compiled.py)."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
from torch import nn

from memfit.measure.step import LossFn
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainty, timed_step
from memfit.policy import KEEP, Option, Policies
from memfit.runtime.apply import set_policies
from memfit.runtime.harness import StepHarness, StepRun
from memfit.steps.compiled_budget import compiler
from memfit.torch_private import more_compiled_versions
from memfit.trainstep import TrainStep


def compiled_step_times(model: nn.Module, inputs: Any, policies: Policies, backend: str, *,
                        loss_fn: LossFn | None = None, step: TrainStep | None = None,
                        steps: int = 5, memory_budget: float | None = None) -> tuple[float, float, float]:
    """Median compiled step time of the plain model, the median ratio of the scheduled
    compiled step's (under the partitioner's ``memory_budget``, if any) to it and that ratio's
    uncertainty (``CompiledSteps.times``)."""
    with CompiledSteps(model, inputs, backend, loss_fn=loss_fn, step=step) as compiled:
        return compiled.times(policies, steps, memory_budget=memory_budget)


def _scheduled(policies: Policies) -> Policies:
    return {n: p for n, p in policies.items() if p != KEEP}


# a plan: its scheduled units in name order, and the partitioner's memory budget (None: its default)
Key = tuple[tuple[tuple[str, Option], ...], float | None]


def _key(policies: Policies, memory_budget: float | None) -> Key:
    return tuple(sorted(_scheduled(policies).items())), memory_budget


class _Copy:
    """A copy of the model under a set of policies, compiled: its harness and compiled module."""

    __slots__ = ("harness", "runner", "state")

    def __init__(self, harness: StepHarness, runner: nn.Module) -> None:
        self.harness, self.runner = harness, runner
        self.state: Any = None  # the timed steps' optimizer, made by their first step


class CompiledSteps:
    """Compiled training steps of copies of ``model``, each copy compiled once and kept while it
    is measured: its peak (``peak``) and its time against the plain copy's (``times``), which is
    compiled once for all, or against another plan's, kept likewise. A plan is a set of policies
    and, optionally, the partitioner's memory budget to compile under (steps/compiled_budget.py).
    Beside the model, two copies at once as compiled planning uses it (the plain one or a
    reference, and the one measured): on a device, each holds its weights, gradients and optimizer
    state. A compiled model is not
    switched between plans (each switch would compile again). Dynamo keeps a version of the
    model's forward per copy, so ``versions`` more are allowed for the duration
    (``more_compiled_versions``); leaving clears torch.compile's caches. The model itself is not
    touched."""

    def __init__(self, model: nn.Module, inputs: Any, backend: str, *, loss_fn: LossFn | None = None,
                 step: TrainStep | None = None, versions: int = 2) -> None:
        self._model, self._inputs, self._backend = model, inputs, backend
        self._loss_fn, self._step = loss_fn, step
        self._limits = more_compiled_versions(versions)
        self._plain: _Copy | None = None
        self._last: tuple[Key, _Copy] | None = None
        self._against: tuple[Key, _Copy] | None = None

    def __enter__(self) -> CompiledSteps:
        self._limits.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._plain = self._last = self._against = None
        try:
            torch.compiler.reset()  # the next plan's hooks differ: start it from a clean cache
        finally:
            self._limits.__exit__(*exc)

    def _copy(self, policies: Policies, memory_budget: float | None = None, *, fresh: bool = False) -> _Copy:
        """The compiled copy of a plan (``none`` on every unit: the plain copy); ``fresh``: built
        anew, from the model's state."""
        key = _key(policies, memory_budget)
        if key == _key({}, None) and self._plain is not None and not fresh:
            return self._plain
        if self._last is not None and self._last[0] == key and not fresh:
            return self._last[1]
        made = self._build(policies, memory_budget)
        if key == _key({}, None):
            self._plain = made
        else:
            self._last = (key, made)
        return made

    def _reference(self, policies: Policies) -> _Copy:
        """The compiled copy under ``policies`` that others are timed against, kept between calls."""
        key = _key(policies, None)
        if self._against is None or self._against[0] != key:
            self._against = (key, self._build(policies, None))
        return self._against[1]

    def _build(self, policies: Policies, memory_budget: float | None) -> _Copy:
        model = copy.deepcopy(self._model)
        set_policies(model, _scheduled(policies))
        model.train()
        return _Copy(StepHarness(model, self._inputs, loss_fn=self._loss_fn, step=self._step),
                     torch.compile(model, backend=compiler(self._backend, memory_budget)))

    def peak(self, policies: Policies, memory_budget: float | None = None) -> int:
        """The measured peak of a steady-state compiled step of a plan (as ``compiled_peak``)."""
        made = self._copy(policies, memory_budget)
        return made.harness.run(runner=made.runner).peak_bytes

    def first_run(self, policies: Policies, memory_budget: float | None = None) -> StepRun:
        """The steps ``peak`` measures, of a copy of the plan built anew from the model's state:
        its losses and gradients compare with another plan's first run."""
        made = self._copy(policies, memory_budget, fresh=True)
        return made.harness.run(runner=made.runner)

    def times(self, policies: Policies, rounds: int, *, against: Policies | None = None,
              memory_budget: float | None = None) -> tuple[float, float, float]:
        """Median compiled step time of the plain copy (or of the copy under ``against``, kept
        for the next call), the median ratio of the copy of the plan (``policies`` under
        ``memory_budget``) to it and that ratio's uncertainty (``ratio_uncertainty``),
        interleaved over ``rounds`` rounds as ``alternate`` does."""
        pair = [self._copy({}) if against is None else self._reference(against), self._copy(policies, memory_budget)]
        for made in pair:
            if made.state is None:
                made.state = made.harness.new_state()

        def timed(k: int) -> float:
            made = pair[k]
            return timed_step(made.runner, made.harness.inputs, made.harness.loss_fn, made.state, made.harness.device)

        plain, sched = alternate(timed, 2, rounds)  # each timed step follows an untimed one (the first compiles)
        return statistics.median(plain), median_ratio(plain, sched), ratio_uncertainty(plain, sched)
