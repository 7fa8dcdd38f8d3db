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
from memfit.runtime.harness import StepHarness
from memfit.torch_private import more_compiled_versions
from memfit.trainstep import TrainStep


def compiled_step_times(model: nn.Module, inputs: Any, policies: Policies, backend: str, *,
                        loss_fn: LossFn | None = None, step: TrainStep | None = None,
                        steps: int = 5) -> tuple[float, float, float]:
    """Median compiled step time of the plain model, the median ratio of the scheduled
    compiled step's to it and that ratio's uncertainty (``CompiledSteps.times``)."""
    with CompiledSteps(model, inputs, backend, loss_fn=loss_fn, step=step) as compiled:
        return compiled.times(policies, steps)


def _scheduled(policies: Policies) -> Policies:
    return {n: p for n, p in policies.items() if p != KEEP}


def _key(policies: Policies) -> tuple[tuple[str, Option], ...]:
    return tuple(sorted(_scheduled(policies).items()))


class _Copy:
    """A copy of the model under a set of policies, compiled: its harness and compiled module."""

    __slots__ = ("harness", "runner", "state")

    def __init__(self, harness: StepHarness, runner: nn.Module) -> None:
        self.harness, self.runner = harness, runner
        self.state: Any = None  # the timed steps' optimizer, made by their first step


class CompiledSteps:
    """Compiled training steps of copies of ``model``, each copy compiled once and kept while it
    is measured: its peak (``peak``) and its time against the plain copy's (``times``), which is
    compiled once for all. A compiled model is not switched between plans (each switch would
    compile again). Dynamo keeps a version of the model's forward per copy, so ``versions`` more
    are allowed for the duration (``more_compiled_versions``); leaving clears torch.compile's
    caches. The model itself is not touched."""

    def __init__(self, model: nn.Module, inputs: Any, backend: str, *, loss_fn: LossFn | None = None,
                 step: TrainStep | None = None, versions: int = 2) -> None:
        self._model, self._inputs, self._backend = model, inputs, backend
        self._loss_fn, self._step = loss_fn, step
        self._limits = more_compiled_versions(versions)
        self._plain: _Copy | None = None
        self._last: tuple[Policies, _Copy] | None = None
        self._kept: dict[tuple[tuple[str, Option], ...], _Copy] = {}

    def __enter__(self) -> CompiledSteps:
        self._limits.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._plain = self._last = None
        self._kept.clear()
        try:
            torch.compiler.reset()  # the next plan's hooks differ: start it from a clean cache
        finally:
            self._limits.__exit__(*exc)

    def _copy(self, policies: Policies) -> _Copy:
        """The compiled copy under ``policies`` (``none`` on every unit: the plain copy)."""
        scheduled = _scheduled(policies)
        if not scheduled and self._plain is not None:
            return self._plain
        if self._last is not None and self._last[0] == scheduled:
            return self._last[1]
        made = self._build(scheduled)
        if scheduled:
            self._last = (scheduled, made)
        else:
            self._plain = made
        return made

    def _build(self, policies: Policies) -> _Copy:
        model = copy.deepcopy(self._model)
        set_policies(model, policies)
        model.train()
        return _Copy(StepHarness(model, self._inputs, loss_fn=self._loss_fn, step=self._step),
                     torch.compile(model, backend=self._backend))

    def peak(self, policies: Policies, *, keep: bool = False) -> int:
        """The measured peak of a steady-state compiled step under ``policies`` (as
        ``compiled_peak``); ``keep``: its copy stays compiled for ``series``."""
        made = self._copy(policies)
        if keep:
            self._kept[_key(policies)] = made
        return made.harness.run(runner=made.runner).peak_bytes

    def times(self, policies: Policies, rounds: int) -> tuple[float, float, float]:
        """Median compiled step time of the plain copy, the median ratio of the copy under
        ``policies`` to it and that ratio's uncertainty (``ratio_uncertainty``), interleaved over
        ``rounds`` rounds as ``alternate`` does."""
        pair = [self._copy({}), self._copy(policies)]
        for made in pair:
            if made.state is None:
                made.state = made.harness.new_state()

        def timed(k: int) -> float:
            made = pair[k]
            return timed_step(made.runner, made.harness.inputs, made.harness.loss_fn, made.state, made.harness.device)

        plain, sched = alternate(timed, 2, rounds)  # each timed step follows an untimed one (the first compiles)
        return statistics.median(plain), median_ratio(plain, sched), ratio_uncertainty(plain, sched)

    def series(self, plans: list[Policies], rounds: int) -> list[float]:
        """The median ratio of each plan's compiled step to the first's, all copies compiled at
        once and timed in one interleaved series (no plain copy: each plan's copy fits)."""
        made = [self._kept.pop(_key(policies), None) or self._build(_scheduled(policies)) for policies in plans]
        states = [m.harness.new_state() for m in made]

        def timed(k: int) -> float:
            m = made[k]
            return timed_step(m.runner, m.harness.inputs, m.harness.loss_fn, states[k], m.harness.device)

        times = alternate(timed, len(made), rounds)
        return [median_ratio(times[0], t) for t in times]
