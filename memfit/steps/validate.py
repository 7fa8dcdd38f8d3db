"""validate(): run the plain and the scheduled model, and compare measured with predicted."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.errors import EagerPlanCompiledWarning, MemfitError, ScheduleMismatchError
from memfit.formats.schedule import Schedule
from memfit.measure.inputs import Inputs
from memfit.measure.memory import CudaFigures
from memfit.measure.step import LossFn, device_of
from memfit.measure.userstep import StepFn
from memfit.policy import Policies
from memfit.runtime.harness import StepHarness, StepRun
from memfit.trainstep import OptimizerFactory, TrainStep, step_difference, step_of

TIME_TOLERANCE = 0.05  # of the plain step: 5 slowdown points


@dataclass(slots=True)
class Validation:
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    plain_peak_bytes: int
    predicted_overhead: float
    measured_overhead: float  # median over rounds of scheduled / plain step time, minus 1 (see step_times)
    plain_step_s: float  # median plain step
    step_s: float  # plain_step_s times the measured ratio
    max_grad_diff: float
    losses_equal: bool
    grads_equal: bool
    buffers_equal: bool
    compile: str | None = None  # the torch.compile backend both models ran under
    compile_memory_budget: float | None = None  # the partitioner's, the scheduled model's (the plan's)
    edited: bool = False  # the schedule's policies were changed after planning: the predictions are not theirs
    cuda: CudaFigures | None = None  # on a GPU: the scheduled step's reserved peak and free memory
    overhead_uncertainty: float = float("nan")  # measured_overhead's (``ratio_uncertainty``; NaN: too few rounds)
    # where kernels are not bit-reproducible (CUDA, inductor): the plain step against itself, run
    # twice; the scheduled step's gradients may differ from the plain ones by about as much
    plain_grad_diff: float = 0.0
    time_tolerance: float = TIME_TOLERANCE  # slowdown points the measurement may differ from the plan by
    rank_peaks: list[int] = field(default_factory=list)  # a per-rank schedule: each rank's measured peak
    reserved_ratio: float | None = None  # the schedule's: the allocator model's reserved over allocated

    @property
    def time_judged(self) -> bool:
        """Enough timed rounds to say how sure the measurement itself is (``ratio_uncertainty``)."""
        return math.isfinite(self.measured_overhead) and math.isfinite(self.overhead_uncertainty)

    @property
    def time_ok(self) -> bool:
        """The measured slowdown is the predicted one within the tolerance, widened by the
        measurement's own uncertainty (a difference below it is not one this run can show); true
        when time was not judged."""
        gap = abs(self.measured_overhead - self.predicted_overhead)
        return not self.time_judged or gap <= self.time_tolerance + self.overhead_uncertainty

    @property
    def context_bytes(self) -> int | None:
        """What the process held outside the caching allocator (CUDA context, libraries' workspaces)."""
        c = self.cuda
        return None if c is None else c["total_bytes"] - c["free_bytes"] - c["reserved_bytes"]

    @property
    def margin(self) -> float | None:
        """The allocator's reserved peak over the allocated peak, less one: devices.MemoryRecord's margin."""
        return None if self.cuda is None else self.cuda["reserved_peak_bytes"] / self.measured_peak_bytes - 1

    @property
    def over_model(self) -> float | None:
        """The card's reserved peak over what the allocator's model predicted for this plan (a plan
        made in estimate mode), less one: devices.MemoryRecord's ``over_model``."""
        if self.cuda is None or self.reserved_ratio is None:
            return None
        return self.cuda["reserved_peak_bytes"] / (self.measured_peak_bytes * self.reserved_ratio) - 1

    @property
    def reserved_fits(self) -> bool:
        """The reserved peak and the context fit the card: the step did not need more than it has."""
        c, context = self.cuda, self.context_bytes
        return c is None or context is None or c["reserved_peak_bytes"] + context <= c["total_bytes"]

    @property
    def error(self) -> float:
        """(predicted - measured) / measured: positive means the plan was cautious."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def fits(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def ok(self) -> bool:
        return (self.fits and self.reserved_fits and self.losses_equal and self.grads_equal and self.buffers_equal
                and not self.edited and self.time_ok)


def step_times(
    model: nn.Module, inputs: Any, schedules: list[Policies], *, loss_fn: LossFn | None = None,
    optimizer: str | OptimizerFactory | None = "adamw", step: TrainStep | None = None, steps: int = 5,
) -> tuple[float, list[float]]:
    """``StepHarness.step_times``: the plain model's median step time, and each schedule's
    median ratio to it in the same round. ``model`` is left as it was."""
    harness = StepHarness(model, inputs, loss_fn=loss_fn, step=step_of(step, optimizer))
    with harness.restoring():
        plain, ratios, _ = harness.step_times(schedules, steps)
    return plain, ratios


def validate(
    model: nn.Module, inputs: Any, schedule: Schedule, *, loss_fn: LossFn | None = None,
    optimizer: str | OptimizerFactory | None = "schedule", step: TrainStep | None = None, steps: int = 5,
    compile: str | None = None, step_fn: StepFn | None = None, time_tolerance: float = TIME_TOLERANCE,
) -> Validation:
    """Measure the plain model and the scheduled model on the same state and RNG, and compare
    peak memory, losses, gradients and buffers; time ``steps`` rounds of the two in alternation
    (``steps=0``: no timing, the time fields are NaN). ``model`` is left as it was.

    The step run is the one the schedule was planned for (its optimizer, micro-batches,
    precision, clipping), unless ``step`` (or ``optimizer``) is given, as it must be for a
    callable optimizer; another step, or inputs of other shapes than the plan's (of a schedule
    for several shapes, than one of its plans', which is then the one validated), raise
    ``ScheduleMismatchError``: the measured peak would then be another step's and prove
    nothing about the plan. A plan made for a step function of your own needs it again
    (``step_fn``), and runs it.

    ``compile`` (a ``torch.compile`` backend; by default the one the schedule was planned for,
    see ``plan_compiled``) runs both models compiled and compares with the compiled peak
    measured at planning.

    Time is judged too, from ``MIN_TIMED_ROUNDS`` (3) rounds on: the validation fails when the
    measured slowdown differs from the predicted one by more than ``time_tolerance`` (a
    fraction of the plain step) plus the measurement's own uncertainty."""
    from memfit.steps.compiled_budget import compiler, with_backend
    from memfit.steps.compiled_steps import compiled_step_times

    backend, memory_budget, predicted_peak = with_backend(schedule, compile)
    train_step = _user_step(schedule, step_fn, step, optimizer) if step_fn is not None or (schedule.step or {}).get(
        "function") else _planned_step(schedule, step, optimizer)
    schedule = _plan_for(schedule, inputs)
    harness = StepHarness(model, inputs, loss_fn=loss_fn, step=train_step, step_fn=step_fn)
    if not (math.isfinite(time_tolerance) and time_tolerance >= 0):
        raise MemfitError(f"time_tolerance is a fraction of the plain step, 0 or more (0.05: 5 points); got "
                          f"{time_tolerance}")
    plain_s, ratio, sure = float("nan"), float("nan"), float("nan")
    exact = repeats_exactly(model, backend)
    with harness.restoring() as found:  # each run from the state the model came in
        plain = harness.run(compile=backend)
        found.restore()
        again = None if exact else harness.run(compile=backend)
        found.restore()
        with harness.scheduled(schedule), warnings.catch_warnings():
            warnings.simplefilter("ignore", EagerPlanCompiledWarning)  # what validate --compile is asked to check
            sched = harness.run(compile=None if backend is None else compiler(backend, memory_budget))
        found.restore()
        if steps > 0 and backend is not None:
            plain_s, ratio, sure = compiled_step_times(model, inputs, schedule.policies, backend, loss_fn=loss_fn,
                                                 step=train_step, steps=steps, memory_budget=memory_budget)
        elif steps > 0:
            plain_s, (ratio,), (sure,) = harness.step_times([schedule.policies], steps)
    return Validation(
        budget_bytes=schedule.budget_bytes,
        predicted_peak_bytes=predicted_peak,
        measured_peak_bytes=sched.peak_bytes,
        plain_peak_bytes=plain.peak_bytes,
        predicted_overhead=schedule.predicted_overhead,
        measured_overhead=ratio - 1.0,
        plain_step_s=plain_s,
        step_s=plain_s * ratio,
        compile=backend,
        compile_memory_budget=memory_budget,
        edited=schedule.edited,
        cuda=sched.cuda,
        overhead_uncertainty=sure,
        time_tolerance=time_tolerance,
        reserved_ratio=schedule.reserved_ratio,
        **agreement(plain, sched, again),
    )


def agreement(plain: StepRun, sched: StepRun, again: StepRun | None) -> dict[str, Any]:
    """``Validation``'s fields for whether ``sched`` gave ``plain``'s results: losses and
    gradients bit for bit, or, where ``again`` (the plain step run once more) shows the kernels do
    not repeat exactly, within that scatter; buffers bit for bit."""
    noise = None if again is None else _differences(plain.grads, again.grads)
    same = _same if again is None else _close
    diff, grads_equal = _compare_grads(plain.grads, sched.grads, noise)
    return {"max_grad_diff": diff, "losses_equal": same(torch.tensor(plain.losses), torch.tensor(sched.losses)),
            "grads_equal": grads_equal,
            "buffers_equal": all(_same(b, sched.buffers[n]) for n, b in plain.buffers.items()),
            "plain_grad_diff": max((noise or {}).values(), default=0.0)}


def repeats_exactly(model: nn.Module, backend: str | None) -> bool:
    """Whether two runs of one step give the same bits: on the CPU in eager kernels. CUDA's
    atomics (embedding and attention backward) and inductor's fused reductions do not even repeat
    the plain step exactly; there the scheduled gradients are judged against the plain step's
    difference from itself (measured on an H200: BERT-large's plain step differed from itself by
    up to 9.6e-5, the scheduled one from it by 9.4e-5)."""
    return device_of(model).type == "cpu" and backend in (None, "eager", "aot_eager")


def _user_step(schedule: Schedule, step_fn: StepFn | None, step: TrainStep | None, optimizer: Any) -> TrainStep:
    """A plan for a step function of the user's own is validated with it, and only with it."""
    planned = (schedule.step or {}).get("function")
    if step_fn is None:
        raise ScheduleMismatchError(f"the schedule was planned for the step function {planned}: validate with "
                                    "step_fn= (memfit cannot rebuild it from the file)")
    if not planned or step is not None or optimizer != "schedule":
        raise ScheduleMismatchError("step_fn= validates a plan made with a step function (profile(step_fn=...)), "
                                    "alone: this schedule was " + ("not" if not planned else "given a step= too"))
    return TrainStep(None)


def _planned_step(schedule: Schedule, step: TrainStep | None, optimizer: Any) -> TrainStep:
    """The step to validate with: the plan's; another one is a mismatch."""
    if step is None and optimizer == "schedule":
        return schedule.train_step
    given = step_of(step, schedule.optimizer if optimizer == "schedule" else optimizer)
    if given.optimizer_name != schedule.optimizer:
        raise ScheduleMismatchError(
            f"the schedule was planned with optimizer {schedule.optimizer!r}, whose state its peak counts; "
            f"validate with that one (got {given.optimizer_name!r}), or plan again with yours"
        )
    differs = step_difference(schedule.optimizer, schedule.step, given)
    if differs:
        raise ScheduleMismatchError(f"the schedule was {differs}: its peak is another step's; validate with the "
                                    "planned step, or plan again with yours")
    return given


def _plan_for(schedule: Schedule, inputs: Any) -> Schedule:
    """The schedule's plan for these inputs (of a schedule for several shapes, that shape's)."""
    shapes = Inputs.of(inputs).describe()
    found = next((p for p in schedule.plans if p.input_shapes == shapes), None)
    if found is not None or not schedule.input_shapes:
        return found or schedule
    planned = " or ".join(p.input_shapes for p in schedule.plans)
    raise ScheduleMismatchError(
        f"the schedule was planned for inputs {planned}, these are {shapes}: activation memory grows with batch "
        "size and sequence length; validate with the planned inputs, or plan again")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest element difference (NaN counted as none; 0 for empty tensors)."""
    return (a - b).abs().nan_to_num(0.0).max().item() if a.numel() else 0.0


def _differences(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Each gradient's largest element difference between two runs (where both have it)."""
    return {n: _max_diff(g, h) for n, g in a.items() if g is not None and (h := b[n]) is not None}


def _compare_grads(plain: dict[str, torch.Tensor | None], sched: dict[str, torch.Tensor | None],
                   noise: dict[str, float] | None) -> tuple[float, bool]:
    """The largest gradient difference, and whether every gradient is the same (or both absent):
    bit for bit where ``noise`` is None, else ``_close`` given each gradient's difference between
    two plain runs."""
    diff, equal = 0.0, True
    for name, g in plain.items():
        h = sched[name]
        if (g is None) != (h is None):
            equal = False
        elif g is not None and h is not None:
            diff = max(diff, _max_diff(g, h))
            equal &= _same(g, h) if noise is None else _close(g, h, noise.get(name, 0.0))
    return diff, equal


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN: a step whose loss is NaN (an fp16 overflow)
    must not make the plain and the scheduled runs differ."""
    if a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype:
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(a, b))


def _close(a: torch.Tensor, b: torch.Tensor, noise: float = 0.0) -> bool:
    """Equal within 1e-5 of the larger magnitude, or within twice ``noise`` (the largest
    difference of the plain step from itself), NaN where the other is NaN."""
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = max(1.0, a.abs().nan_to_num(0.0).max().item())
    return _same(a.isnan(), b.isnan()) and _max_diff(a, b) <= max(2 * noise, 1e-5 * scale)


def measure_plans(
    model: nn.Module, inputs: Any, plans: list[Policies], *, loss_fn: LossFn | None = None,
    optimizer: str | None = "adamw", step: TrainStep | None = None, steps: int = 3,
    progress: Callable[[], None] | None = None,
) -> tuple[list[int], list[float], list[float]]:
    """The measured peak bytes, slowdown and its uncertainty (two standard errors, NaN below 3
    rounds) of each plan, by ``validate``'s machinery: each peak from a steady-state step of its
    own, the slowdowns from one interleaved series of timed rounds that all plans share with the
    plain model. ``model`` is left as it was."""
    harness = StepHarness(model, inputs, loss_fn=loss_fn, step=step_of(step, optimizer))
    peaks = []
    with harness.restoring() as found:  # each plan from the state the model came in
        for policies in plans:
            with harness.options(policies):
                peaks.append(harness.run().peak_bytes)
            found.restore()
            if progress is not None:
                progress()
        _, ratios, sure = harness.step_times(plans, steps)
    return peaks, [r - 1.0 for r in ratios], sure


def measure_levels(
    model: nn.Module, inputs: Any, schedule: Schedule, *, loss_fn: LossFn | None = None,
    optimizer: str | None = "adamw", step: TrainStep | None = None,
) -> list[list[Any]]:
    """The measured (mark, live bytes at it, peak until the next mark) of one steady-state step
    of the scheduled model, at the marks the profiler sets: the measured side of a timeline,
    phase for phase beside ``schedule.levels["plan"]``. ``model`` is left as it was."""
    harness = StepHarness(model, inputs, loss_fn=loss_fn, step=step_of(step, optimizer))
    with harness.restoring(), harness.scheduled(schedule):
        return harness.levels(list(schedule.policies))
