"""Planning for a step that runs under ``torch.compile``.

A compiled step does not keep what the eager one keeps: AOTAutograd's partitioner chooses the
saved tensors, fuses, and under inductor may keep more than eager at the same plan (measured on
the tiny GPT: 2.55 MB compiled vs 2.50 MB eager with every block checkpointed). So the eager
profile's prediction is not promised for a compiled model; the plan is checked against the
compiled step itself, measured, and tightened until that fits. Segments are ruled out: under
``torch.compile`` each member of a segment is its own checkpoint (see regions.py).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from memfit.budget import format_bytes, parse_bytes
from memfit.errors import InfeasibleBudgetError, MemfitError
from memfit.formats.profile import OptionCost, Profile
from memfit.formats.schedule import CompiledPeak, Schedule
from memfit.measure.step import LossFn
from memfit.planning.options import PlanOptions, settle
from memfit.planning.peak import predict
from memfit.policy import COARSE, FULL, KEEP, Option, Policies
from memfit.runtime.harness import StepHarness, StepRun
from memfit.steps.compiled_budget import check_backend, largest_fitting
from memfit.steps.compiled_steps import CompiledSteps
from memfit.trainstep import TrainStep, step_of

ROUNDS = 4  # re-plans at most; each costs a compilation
TIME_ROUNDS = 5  # interleaved rounds that time each option's compiled step (compiled_figures)
_FITS = 3  # passes that move an option's figures toward its measured compiled peak
FINALISTS = 3  # other fitting plans timed against the one from the figures (plan_compiled)
FINAL_ROUNDS = 11  # interleaved rounds that time the finalists


def compiled_peak(model: nn.Module, inputs: Any, policies: Policies, backend: str, *,
                  loss_fn: LossFn | None = None, optimizer: str | None = "adamw",
                  step: TrainStep | None = None) -> int:
    """The measured peak of a steady-state compiled step of ``model`` under ``policies``;
    ``model`` is left as it was."""
    harness = StepHarness(model, inputs, loss_fn=loss_fn, step=step_of(step, optimizer))
    try:
        with harness.restoring(), harness.options(policies):
            return harness.run(compile=backend).peak_bytes
    finally:
        torch.compiler.reset()  # the next plan's hooks differ: start it from a clean cache


def compiled_figures(model: nn.Module, inputs: Any, profile: Profile, backend: str, *,
                     options: Collection[Option] | None = None, rounds: int = TIME_ROUNDS,
                     loss_fn: LossFn | None = None, step: TrainStep | None = None,
                     progress: Callable[[str], None] | None = None) -> Profile:
    """A copy of ``profile`` whose options keep what they keep in the step compiled with
    ``backend``: for each option (``none`` first), the compiled step with every unit that has it
    under it is measured, and the figures of those units' option are moved, by each unit's share,
    until the eager memory model predicts that measured peak.

    Why: the partitioner keeps other tensors than eager autograd, and not by a constant. On
    vit-tiny the plain compiled step keeps 21 MiB more than the eager one while each ``derive``
    level keeps to the byte what it keeps eagerly, and a chain of leaf children frees 30 MiB
    eagerly and nothing compiled; planned from the eager figures, a compiled plan buys the wrong
    options. A unit's share of a gap is what it keeps (``none``) or what the option frees from it
    eagerly (the rest), so units of different sizes move in proportion. The options moved: those
    in ``options`` (default: every one the profile measured; ``none`` always); the others keep
    their eager figures.

    Times too, where ``rounds`` > 0: the eager prices mislead a compiled plan (on uneven-gpt,
    ``derive`` on every block costs +8% eager and +4.3% compiled, ``derive:all`` +28.5% and
    +18.4%, ``full`` +29.7% and +21.9%: the compiled step runs no saved-tensor hooks and
    recomputes only what the policy names). Each option's compiled step is timed against the plain
    compiled step, interleaved over ``rounds`` rounds (``CompiledSteps``: one compilation per
    option, the one whose peak was measured, and one of the plain model for all), and its units'
    times are scaled so that they add up to that overhead, each unit keeping its eager share;
    ``step_s`` becomes the plain compiled step's. ``measured_peak_bytes`` holds the compiled peaks
    of the options every unit has.
    """
    fixed = copy.deepcopy(profile)
    kinds: dict[Option, list[int]] = {}
    for j, unit in enumerate(fixed.units):
        for option in unit.options:
            if options is None or option == KEEP or option in options:
                kinds.setdefault(option, []).append(j)
    plains: list[float] = []
    with CompiledSteps(model, inputs, backend, loss_fn=loss_fn, step=step, versions=len(kinds) + 1) as compiled:
        for option, js in sorted(kinds.items(), key=lambda kv: kv[0] != KEEP):
            policies = {fixed.units[j].name: option for j in js}
            if progress is not None:
                progress(f"compiling ({backend}) and measuring {len(js)} unit(s) under {option}")
            peak = compiled.peak(policies)
            _move_to(fixed, option, js, peak)
            if len(js) == len(fixed.units):  # the step with every unit under it: the record's own figure
                fixed.measured_peak_bytes[option] = peak
            if rounds > 0 and option != KEEP:
                plain_s, ratio, sure = compiled.times(policies, rounds)
                plains.append(plain_s)
                _scale_times([fixed.units[j].options[option] for j in js], max(0.0, ratio - 1) * plain_s,
                             sure * plain_s)
    if plains:
        fixed.step_s = statistics.median(plains)
    return fixed


def _shares(weights: list[float]) -> list[float]:
    """Each weight's share of their sum; equal shares where they sum to nothing."""
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else [1 / len(weights)] * len(weights)


def _scale_times(costs: list[OptionCost], total_s: float, sure_s: float) -> None:
    """Scale ``costs``' times to add up to ``total_s`` (their uncertainties to ``sure_s``), each
    keeping its share of their eager sum."""
    for c, share in zip(costs, _shares([c.recompute_s for c in costs]), strict=True):
        c.recompute_s, c.recompute_uncertainty_s = total_s * share, sure_s * share


def _move_to(profile: Profile, option: Option, js: list[int], peak: int) -> None:
    """Move the figures of ``option`` on units ``js`` (in place) until ``predict`` with those units
    under it gives ``peak``, by each unit's share (``compiled_figures``); a pass that brings the
    prediction no nearer is undone (the peak lies where the option's figures do not reach)."""
    policies = {profile.units[j].name: option for j in js}
    gap = peak - predict(profile, policies).peak_bytes
    for _ in range(_FITS):
        if gap == 0:
            return
        costs = [profile.units[j].options[option] for j in js]
        kept = [profile.units[j].options[KEEP].stored_bytes for j in js]
        weights = [max(0, k if option == KEEP else k - c.stored_bytes) for c, k in zip(costs, kept, strict=True)]
        moves = [round(gap * share) for share in _shares(weights)]
        _shift(costs, moves)
        left = peak - predict(profile, policies).peak_bytes
        if abs(left) >= abs(gap):
            _shift(costs, [-m for m in moves])
            return
        gap = left


def _shift(costs: list[OptionCost], moves: list[int]) -> None:
    """Keep ``move`` bytes more past each option's forward, freed by its backward."""
    for c, move in zip(costs, moves, strict=True):
        c.stored_bytes += move
        c.fwd_peak_bytes += move
        c.bwd_end_bytes -= move
        if c.later_bwd_end_bytes is not None:
            c.later_bwd_end_bytes -= move


def plan_compiled(model: nn.Module, inputs: Any, profile: Profile, budget: str | int, backend: str,
                  options: PlanOptions | None = None, *, loss_fn: LossFn | None = None,
                  step: TrainStep | None = None, progress: Callable[[str], None] | None = None,
                  figures: Profile | None = None, finalists: int = FINALISTS, compiler_budget: bool = True,
                  **settings: Any) -> Schedule:
    """The plan for ``model`` compiled with ``backend`` whose measured compiled peak fits ``budget``
    at the least predicted recompute time among the plans tried, or a finalist measured faster.

    Plans without segments from the profile's memory figures and times moved to the compiled
    step's (``compiled_figures``: one compilation per option), measures the plan's compiled step, and
    plans again with the budget moved by the gap between the compiled peak and ``budget`` (down when
    it did not fit, up when it left room), until a plan recurs or ``ROUNDS`` are spent. The
    schedule records the backend and the measured peak in ``schedule.compile``, which
    ``validate`` compares with. Raises ``InfeasibleBudgetError`` when no plan's compiled step
    fits. Clears torch.compile's caches after each measurement. ``step``: the training step, by
    default the profile's (needed again for a callable optimizer). ``options`` and ``settings``:
    the planning settings as in ``plan``, whose segments are turned off (a compiled segment keeps
    every member's input). ``figures``: ``compiled_figures`` of ``profile`` for this backend, made
    already (several budgets, one set of compilations).

    Then up to ``finalists`` other plans that fit are timed against it, compiled, each in an
    interleaved series of ``FINAL_ROUNDS`` rounds, and the fastest is returned: each is planned
    from the figures without one of the finer options the first plan chose, and kept where its
    compiled step is measured to fit. Why: an option's compiled price comes from 5 rounds,
    noisier than the point that separates two cheap options, and the planner takes whichever
    noise favours (on vit-tiny at compile's 0.6 peak, ``derive:products@attention`` on one block
    where ``derive`` on all six fits to the byte). The compiler's own plan is timed beside them
    (``_compilers_own``: no unit of memfit's, the partitioner's activation memory budget found by
    bisection to fit, its gradients the plain step's), and returned where it is the fastest, with
    ``strategy`` "compiler" and the budget in ``schedule.compile``: compile with
    ``memfit.compile_backend(schedule)``; ``compiler_budget=False`` leaves it out (where the compile
    call takes a backend by name only). ``finalists=0``: the plan from the figures alone.
    """
    from memfit.planning.planner import plan

    check_backend(backend)
    step = step or profile.train_step
    opts = dataclasses.replace(settle(options, **settings), segments=False)
    if opts.fallbacks:
        raise MemfitError("fallbacks are planned for the eager step only; plan a compiled step without them")
    target = parse_bytes(budget)
    if figures is None:
        figures = compiled_figures(model, inputs, profile, backend, loss_fn=loss_fn, step=step, progress=progress,
                                   options=None if opts.granularity == "fine" else COARSE)
    cap = target
    seen: set[tuple[str, ...]] = set()
    tried: list[tuple[int, int]] = []  # (predicted, compiled measured)
    best: Schedule | None = None
    for _ in range(ROUNDS):
        try:
            schedule = plan(figures, cap, opts)
        except InfeasibleBudgetError:
            break
        key = tuple(schedule.policies.values())
        if key in seen:
            break
        seen.add(key)
        if progress is not None:
            progress(f"compiling ({backend}) and measuring the plan that predicts "
                     f"{format_bytes(schedule.predicted_peak_bytes)} from the compiled figures")
        peak = compiled_peak(model, inputs, schedule.policies, backend, loss_fn=loss_fn, step=step)
        tried.append((schedule.predicted_peak_bytes, peak))
        if peak <= target and (best is None or schedule.predicted_recompute_s < best.predicted_recompute_s):
            schedule.compile = CompiledPeak(backend=backend, peak_bytes=peak)
            best = schedule
        cap = schedule.predicted_peak_bytes + (target - peak)
    if best is not None:
        best.budget_bytes = target
        if finalists > 0:
            best = _fastest(best, figures, opts, finalists, model, inputs, backend, loss_fn=loss_fn, step=step,
                            progress=progress, compiler_budget=compiler_budget)
        return best
    shown = "; ".join(f"{format_bytes(p)} predicted -> {format_bytes(m)} compiled" for p, m in tried)
    least = min((m for _, m in tried), default=target + 1)
    raise InfeasibleBudgetError(
        f"no plan's compiled ({backend}) step fits {format_bytes(target)}"
        + (f" (measured: {shown})" if tried else "") + "; give a larger budget, or plan the eager step",
        least,
    )


def _without(figures: Profile, option: Option) -> Profile:
    """``figures`` with ``option`` offered on no unit."""
    out = copy.deepcopy(figures)
    for unit in out.units:
        unit.options.pop(option, None)
    out.measured_peak_bytes.pop(option, None)
    return out


def _fastest(first: Schedule, figures: Profile, opts: PlanOptions, finalists: int, model: nn.Module, inputs: Any,
             backend: str, *, loss_fn: LossFn | None, step: TrainStep | None,
             progress: Callable[[str], None] | None, compiler_budget: bool) -> Schedule:
    """The fastest compiled step among ``first``, up to ``finalists`` other plans that fit its
    budget (``plan_compiled``) and, with ``compiler_budget``, the compiler's own plan, each timed
    against ``first`` in an interleaved series of its own (two compiled copies at once beside the
    model)."""
    from memfit.planning.planner import plan

    target = first.budget_bytes
    timed: list[tuple[float, Schedule]] = [(1.0, first)]
    seen = {tuple(first.policies.values())}
    with CompiledSteps(model, inputs, backend, loss_fn=loss_fn, step=step, versions=finalists + 12) as compiled:
        for option in dict.fromkeys(p for p in first.policies.values() if p not in (KEEP, FULL)):  # baselines need full
            if len(timed) > finalists:
                break
            try:
                other = plan(_without(figures, option), target, opts)
            except InfeasibleBudgetError:
                continue
            if (key := tuple(other.policies.values())) in seen:
                continue
            seen.add(key)
            if progress is not None:
                progress(f"compiling ({backend}) and measuring a finalist without {option}")
            peak = compiled.peak(other.policies)
            if peak <= target:
                other.compile, other.budget_bytes = CompiledPeak(backend=backend, peak_bytes=peak), target
                timed.append((compiled.times(other.policies, FINAL_ROUNDS, against=first.policies)[1], other))
        own = _compilers_own(compiled, first, figures.step_s, model, backend, progress) if compiler_budget else None
        if own is not None:
            timed.append(own)
    if len(timed) > 1 and progress is not None:
        progress(f"timed {len(timed)} plans that fit, compiled, each against the first over {FINAL_ROUNDS} "
                 "interleaved rounds: " + ", ".join(f"{(r - 1) * 100:+.1f}%" for r, _ in timed))
    return min(timed, key=lambda rs: rs[0])[1]


def _compilers_own(compiled: CompiledSteps, first: Schedule, step_s: float, model: nn.Module, backend: str,
                   progress: Callable[[str], None] | None) -> tuple[float, Schedule] | None:
    """The compiler's own plan (steps/compiled_budget.py): no unit of memfit's, the largest memory
    budget of the partitioner's whose compiled step fits ``first``'s budget, timed against
    ``first`` (the ratio, and the plan); None where none fits, or where its losses or gradients
    are not the plain compiled step's (a plan that changes training is no plan)."""
    from memfit.steps.validate import agreement, repeats_exactly

    say = progress or (lambda _: None)
    runs: dict[float, StepRun] = {}

    def peak_at(memory_budget: float) -> int:
        say(f"compiling ({backend}) and measuring the compiler's own plan at memory budget {memory_budget:g}")
        runs[memory_budget] = compiled.first_run({}, memory_budget)
        return runs[memory_budget].peak_bytes

    found = largest_fitting(peak_at, first.budget_bytes)
    if found is None:
        say(f"no memory budget of the compiler's own fits {format_bytes(first.budget_bytes)}")
        return None
    memory_budget, peak = found
    plain = compiled.first_run({})
    same = agreement(plain, runs[memory_budget], None if repeats_exactly(model, backend) else compiled.first_run({}))
    if not (same["losses_equal"] and same["grads_equal"] and same["buffers_equal"]):
        say(f"the compiler's own plan at memory budget {memory_budget:g} fits, but its gradients are not the plain "
            f"step's (off by up to {same['max_grad_diff']:.3g}; a dropout recomputed with a fresh mask, PyTorch "
            "issue #190758): left out")
        return None
    _, ratio, sure = compiled.times({}, FINAL_ROUNDS, against=first.policies, memory_budget=memory_budget)
    base = 1.0 + first.predicted_overhead  # first's step, in plain compiled steps: ratios to it scale by it
    overhead = max(0.0, base * ratio - 1.0)
    own = dataclasses.replace(
        first, policies=dict.fromkeys(first.policies, KEEP), predicted_peak_bytes=peak,
        predicted_recompute_s=overhead * step_s, predicted_overhead=overhead,
        predicted_uncertainty_s=sure * base * step_s,
        strategy="compiler", solver="torch.compile's partitioner",
        solver_status=f"its own activation memory budget {memory_budget:g}, measured "
                      f"{(ratio - 1) * 100:+.1f}% against memfit's plan", levels={},
        compile=CompiledPeak(backend=backend, peak_bytes=peak, memory_budget=memory_budget))
    return ratio, own
