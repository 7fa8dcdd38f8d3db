"""The step harness: one model's training step as memfit measures it, set up once.

``StepHarness`` owns the step's set-up (inputs, loss, an optimizer of learning rate 0, so that
every step sees the same weights), switching units between options or applying a schedule,
steps from a fixed seed with their measured peak, interleaved timed rounds, the step run with
unit marks, and a full restore (weights, buffers, gradients, every module's mode, the RNG).
The profiler, ``validate``, compiled planning, per-rank profiling, the benchmarks and the tests
all run their steps through it. It sits in the runtime layer, beside ``apply``, because it
switches units between options.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.formats.schedule import Schedule
from memfit.measure.inputs import Inputs
from memfit.measure.memory import CudaFigures, Mark, measured
from memfit.measure.meters import Meters, real_meters
from memfit.measure.step import LossFn, StepState, default_loss, device_of, static_bytes, static_tensors, training_step
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainties, timed_step
from memfit.measure.userstep import StepFn, UserStepState
from memfit.policy import Policies
from memfit.runtime.apply import apply, clear_policies, remove, set_policies
from memfit.runtime.marks import recorded_step, stretches
from memfit.trainstep import OptimizerFactory, TrainStep, step_of


@dataclass(slots=True)
class StepRun:
    """What one configuration did: losses per step, final gradients and buffers, peak."""

    losses: list[float]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    peak_bytes: int
    cuda: CudaFigures | None = None  # on a GPU: the reserved peak and free memory of the measured step


class Snapshot:
    """A model's state as found: buffers (BatchNorm statistics), gradients, every module's
    train/eval mode, the CPU and CUDA RNG, and with ``weights`` the parameters' values (kept on
    the host, so that the copy takes no device memory from the measured step)."""

    def __init__(self, model: nn.Module, *, weights: bool = True,
                 held: Callable[[], None] | None = None) -> None:
        self._held = held  # puts a user step function's optimizers back (UserStepState.snapshot)
        self._training = {m: m.training for m in model.modules()}
        self._buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._params = [(p, p.detach().to("cpu", copy=True)) for p in model.parameters()] if weights else []
        self._grads = [(p, p.grad) for p in model.parameters()]
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in [*self._buffers, *self._params]:
                t.copy_(saved)
        for p, g in self._grads:
            p.grad = g
        for m, mode in self._training.items():
            m.train(mode)
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        if self._held is not None:
            self._held()


class StepHarness:
    """``model``'s training step on ``inputs`` with ``loss_fn`` (default: the output's mean, or
    its ``.loss``), as ``step`` describes it (memfit/trainstep.py; its optimizer's state counts).
    ``foreach_default``: the kernels of a plainly named optimizer (make_optimizer)."""

    def __init__(self, model: nn.Module, inputs: Any, *, loss_fn: LossFn | None = None,
                 step: TrainStep | None = None, foreach_default: bool | None = None,
                 step_fn: StepFn | None = None) -> None:
        self.model = model
        self.inputs = Inputs.of(inputs)
        self.loss_fn = loss_fn or default_loss
        self.step = step or TrainStep()
        self.foreach_default = foreach_default
        self.device = device_of(model)
        self.user = UserStepState(step_fn, model) if step_fn is not None else None  # the user's own step

    def new_state(self) -> StepState | UserStepState:
        """A fresh optimizer (and GradScaler): its state is created by the first step; a step
        function's own optimizers, as they are."""
        if self.user is not None:
            return self.user
        return StepState(self.step, self.model, foreach_default=self.foreach_default)

    @property
    def changes_weights(self) -> bool:
        """The optimizer is the user's own (its learning rate is not 0): its steps move the weights."""
        return self.user is not None or callable(self.step.optimizer)

    @contextmanager
    def restoring(self, *, weights: bool = True) -> Iterator[Snapshot]:
        """Leave the model as found (``Snapshot``); the snapshot it yields can also put the model
        back between runs, so that one copy serves several."""
        snapshot = Snapshot(self.model, weights=weights, held=self.user.snapshot() if self.user else None)
        try:
            yield snapshot
        finally:
            snapshot.restore()

    @contextmanager
    def options(self, policies: Policies) -> Iterator[None]:
        """Units running the given policies (memfit/policy.py) for the duration."""
        set_policies(self.model, policies)
        try:
            yield
        finally:
            clear_policies(self.model)

    @contextmanager
    def switching(self) -> Iterator[Callable[[Policies], None]]:
        """For interleaved series: a function that puts the units in the given policies, changing
        nothing when they already are (``alternate`` runs each configuration's untimed step right
        before its timed one, so the timed step finds the state a loop's steady state has: a
        ``derive`` unit's learned plan, say); every policy is cleared at the end."""
        current: list[Policies | None] = [None]

        def use(policies: Policies) -> None:
            if current[0] is not policies:
                clear_policies(self.model)
                set_policies(self.model, policies)
                current[0] = policies

        try:
            yield use
        finally:
            clear_policies(self.model)

    @contextmanager
    def scheduled(self, schedule: Schedule) -> Iterator[None]:
        """``schedule`` applied as a user applies it (fingerprint checked, watch on), then removed."""
        apply(self.model, schedule)
        try:
            yield
        finally:
            remove(self.model)

    def run(self, steps: int = 2, seed: int = 0, compile: str | Callable[..., Any] | None = None, *,
            runner: nn.Module | None = None) -> StepRun:
        """``steps`` training steps from a fixed seed (the first warms up, and compiles under
        ``compile``, a ``torch.compile`` backend by name or a callable; ``runner``: the model
        compiled already, run again); the peak is the last step's. A fresh optimizer each call:
        its state is created by the warm-up."""
        model, inp, loss = self.model, self.inputs, self.loss_fn
        if self.device.type == "cuda":  # the reserved peak measured is this run's, not an earlier run's cache
            gc.collect()
            torch.cuda.empty_cache()
        if runner is None:
            runner = model if compile is None else torch.compile(model, backend=compile)
        state = self.new_state()
        model.train()
        torch.manual_seed(seed)
        losses = []
        for _ in range(steps - 1):
            state.zero_grad()
            losses.append(training_step(runner, inp, loss, state))
        state.zero_grad()
        last, peak, figures = measured(lambda: training_step(runner, inp, loss, state),
                                       lambda: static_tensors(model, state, inp), self.device)
        losses.append(last)
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        return StepRun(losses, grads, buffers, peak, figures)

    def step_times(self, plans: list[Policies], rounds: int) -> tuple[float, list[float], list[float]]:
        """Median step time of the plain model, the median ratio of each plan's step time to
        the plain step's in the same round (``alternate``), and each ratio's uncertainty
        (``ratio_uncertainties``): one series for all plans, so that they share the plain steps and the
        machine's drift."""
        state = self.new_state()
        self.model.train()
        configs = [{}, *plans]

        with self.switching() as use:
            def timed(k: int) -> float:
                use(configs[k])
                return timed_step(self.model, self.inputs, self.loss_fn, state, self.device)

            plain, *others = alternate(timed, len(configs), rounds)
        return (statistics.median(plain), [median_ratio(plain, t) for t in others],
                ratio_uncertainties(plain, others))

    def marked_step(self, state: StepState | UserStepState, unit_names: list[str], what: str,
                    meters: Meters | None = None) -> list[Mark]:
        """One step with marks at the units' boundaries (runtime/marks.py), read by ``meters``
        (default: the device's own): ``what`` is ``memory`` or ``time``. Two micro-batches at
        most: every later one repeats the second."""
        meters = meters or real_meters(self.device)
        return recorded_step(self.model, unit_names, self.inputs, self.loss_fn, state, meters, what)

    def levels(self, unit_names: list[str]) -> list[list[Any]]:
        """(mark, live bytes at it, peak until the next mark) of one steady-state step as the
        model is now configured, at the marks the profiler sets."""
        state = self.new_state()
        self.model.train()
        state.zero_grad()
        training_step(self.model, self.inputs, self.loss_fn, state)  # warm-up: the optimizer state exists
        state.zero_grad()
        level = static_bytes(self.model, state, self.inputs)
        out = []
        for s in stretches(self.marked_step(state, unit_names, "memory")):
            out.append([s.label, level, level + s.peak])
            level += s.end
        return out


def measure_steps(
    model: nn.Module, inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer: str | OptimizerFactory | None = "adamw", step: TrainStep | None = None,
    steps: int = 2, seed: int = 0, compile: str | Callable[..., Any] | None = None,
) -> StepRun:
    """``StepHarness(model, inputs, ...).run(steps, seed, compile)``: the model as it is now."""
    return StepHarness(model, inputs, loss_fn=loss_fn, step=step_of(step, optimizer)).run(steps, seed, compile)
