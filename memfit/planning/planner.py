"""plan(): the cheapest schedule that fits a budget, re-checked with predict() before it is returned."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from memfit.budget import format_bytes, parse_bytes
from memfit.devices import MemoryRecord, describe_memory
from memfit.errors import InfeasibleBudgetError, InternalError, MemfitError, SolverTimeout
from memfit.formats.layout import ParallelLayout
from memfit.formats.profile import Profile
from memfit.formats.schedule import BaselineFigures, Fallback, Schedule
from memfit.planning.baselines import BASELINES, STRATEGIES, not_applicable, pick, predicted
from memfit.planning.dp import dp_exact
from memfit.planning.ilp import solve
from memfit.planning.intmodel import IntModel
from memfit.planning.options import PlanOptions, settle
from memfit.planning.peak import allocator_ratio, device_cap_bytes, predict
from memfit.planning.roles import policies_of, weighed
from memfit.policy import FULL, Policies
from memfit.trainstep import StepRecord

TIE_FRACTION = 1e-4  # of the step time: recompute times closer than this are one cost to the planner
# Fine solves at real size (32 layers, ~10 options each) find the optimum to 0.1% in seconds and
# then spend an hour proving it: they stop there, and at this many seconds unless told otherwise.
FINE_TIME_LIMIT = 60.0
FINE_GAP = 1e-3


def check_granularity(profile: Profile, granularity: str) -> bool:
    """True for ``fine``, False for ``module`` (PlanOptions checked the name); a fine plan needs a
    profile that measured finer options."""
    if granularity == "fine" and not profile.fine:
        raise MemfitError("granularity 'fine' needs a profile that measured finer options: profile with "
                          "granularity='fine' (memfit profile --granularity fine)")
    return granularity == "fine"


def min_budget_bytes(
    profile: Profile, *, solver: str = "cpsat", segments: bool = True, max_segment: int = 8, fine: bool = False
) -> int:
    """The smallest budget ``plan`` accepts for this profile (strategy ``ilp``; ``fine``: with
    the profile's finer options)."""
    model = IntModel.of(profile, segments=segments, max_segment=max_segment, fine=fine)
    sol = solve(model, None, solver=solver, minimize="peak")
    if sol is None:  # pragma: no cover - minimising the peak always has an answer
        raise MemfitError("the solver found no schedule at all")
    return sol.objective * model.quantum


def plan(
    profile: Profile | Sequence[Profile],
    budget: str | int,
    options: PlanOptions | None = None,
    *,
    strategy: str | None = None,
    solver: str | None = None,
    granularity: str | None = None,
    segments: bool | None = None,
    max_segment: int | None = None,
    time_limit: float | None = None,
    fallbacks: int | None = None,
    shares: Sequence[float] | None = None,
) -> Schedule:
    """The schedule with the least recompute time whose predicted peak fits ``budget``.

    Given profiles of one model at several input shapes (``[memfit.profile(model, x) for x in
    batches]``), one schedule with a plan per shape (``Schedule.shapes``, smallest first), each
    the cheapest that fits ``budget`` at its shape; ``apply`` runs each forward under its shape's
    plan. ``shares`` weigh the shapes (how often each occurs: a length histogram) for
    ``Schedule.expected_overhead``.

    ``fallbacks`` tighter plans are solved too (budgets evenly spaced from this plan's peak down
    to the smallest feasible one) and stored in the schedule, for ``memfit.tighten`` to step
    through when a real run still runs out of memory.

    ``budget`` is bytes or a size such as ``"24GB"`` (binary units). ``strategy`` is ``ilp`` (the
    optimum, by ``solver`` cpsat, cbc or dp) or a baseline: none, full, every-k, sqrt, first-k,
    greedy. ``segments`` lets the ILP checkpoint runs of up to ``max_segment`` units as one
    region when the units form a chain. ``granularity="fine"`` also lets it choose the finer
    options a profile made with ``granularity="fine"`` measured (a child module, an op set,
    derive). The settings are one ``memfit.PlanOptions``: ``options``, with any given as keywords
    put in (``None``: the record's, whose defaults are ilp, cpsat, module, segments of up to 8, no
    time limit, no fallbacks); it checks them once. Raises ``InfeasibleBudgetError`` with the
    smallest budget that works when nothing fits.

    On a GPU (the profile records its memory: a target's, or the measured card's) the budget is
    at most what the card leaves to a step, its usable memory less any FSDP headroom
    (``device_cap_bytes``): a larger budget is planned for that, and the schedule keeps the one
    asked for in ``asked_budget_bytes``.
    """
    opts = settle(options, strategy=strategy, solver=solver, segments=segments, max_segment=max_segment,
                  granularity=granularity, time_limit=time_limit, fallbacks=fallbacks)
    if not isinstance(profile, Profile):
        return _plan_shapes(list(profile), budget, opts, shares)
    if shares is not None:
        raise MemfitError("shares weigh the input shapes of several profiles; one profile has one shape")
    return _plan_one(profile, budget, opts)


def _plan_one(profile: Profile, budget: str | int, opts: PlanOptions) -> Schedule:
    """``plan`` for one profile, with its settings made."""
    strategy = opts.strategy
    fine = check_granularity(profile, opts.granularity)
    budget_bytes = parse_bytes(budget)
    asked = None
    cap = device_cap_bytes(profile)
    if cap is not None and budget_bytes > cap:
        asked, budget_bytes = budget_bytes, cap
    if strategy != "ilp" and (why := not_applicable(profile, strategy)):
        raise MemfitError(f"strategy {strategy} does not apply to this model: {why}")
    for attempt in range(_REPLANS):
        figures, policies, strategy, used, status, seconds = _solved(profile, budget_bytes, opts, fine, asked)
        pred = predict(profile, policies)
        own = device_cap_bytes(profile, policies)  # the allocator's model may leave this plan less
        if own is None or pred.peak_bytes <= own:
            break
        asked = budget_bytes if asked is None else asked
        # planned again for what this plan leaves; the next to last time for what any plan leaves
        budget_bytes = own if attempt < _REPLANS - 2 else _least_cap(profile)
    if pred.peak_bytes > (budget_bytes if own is None else min(budget_bytes, own)):  # the model rounds up: a bug
        raise InternalError(
            f"the schedule predicts {pred.peak_bytes} bytes, over the budget of {budget_bytes}; please report this "
            "with the profile"
        )
    ladder = _fallbacks(profile, pred.peak_bytes, opts, fine)
    return Schedule(
        policies=policies,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_recompute_s=pred.recompute_s,
        predicted_overhead=pred.overhead,
        strategy=strategy,
        solver=used,
        solver_status=status,
        solve_s=seconds,
        fingerprint=dict(profile.fingerprint),
        input_shapes=profile.input_shapes,
        baselines=figures,
        optimizer=profile.optimizer,
        device=profile.device,
        source=dict(profile.source),
        levels={"plan": [list(e) for e in pred.levels], "none": [list(e) for e in predict(profile, {}).levels]},
        fallbacks=ladder,
        target=profile.target,
        parallel=ParallelLayout(**profile.parallel) if profile.parallel else None,
        step=StepRecord(**profile.step) if profile.step else None,
        memory=MemoryRecord(**profile.memory) if profile.memory else None,
        asked_budget_bytes=asked,
        predicted_uncertainty_s=pred.uncertainty_s,
        reserved_ratio=allocator_ratio(profile, policies),
    )


# plans made at most: again where the allocator's model leaves the plan less than it was made for
# (peak.device_cap_bytes), the last at the least cap any plan has, which every plan meets
_REPLANS = 4


def _least_cap(profile: Profile) -> int:
    """The device's cap for the plan the allocator's model leaves least: it interpolates between
    every unit kept and every unit ``full``, so one of those two."""
    caps = [device_cap_bytes(profile, p) for p in ({}, dict.fromkeys(profile.unit_names, FULL))]
    return min(c for c in caps if c is not None)


def _solved(profile: Profile, budget_bytes: int, opts: PlanOptions, fine: bool,
            asked: int | None) -> tuple[dict[str, BaselineFigures], Policies, str, str, str, float]:
    """(baselines, policies, strategy, solver, status, seconds) of the plan at ``budget_bytes``;
    ``asked``: the larger budget the device's cap replaced, which an infeasible budget names."""
    figures = baselines(profile, budget_bytes)  # stored in the schedule, and the ILP's safety net
    try:
        policies, strategy, used, status, seconds = _choose(profile, budget_bytes, opts, fine, figures)
    except InfeasibleBudgetError as exc:
        if asked is None:
            raise
        raise InfeasibleBudgetError(f"{exc} (the budget of {format_bytes(asked)} was more than the device leaves: "
                                    f"{describe_memory(profile.memory)})", exc.min_budget_bytes) from None
    if fine and strategy == "ilp":
        policies, status = _against_module(profile, budget_bytes, opts, figures, policies, status)
    return figures, policies, strategy, used, status, seconds


def _plan_shapes(profiles: list[Profile], budget: str | int, opts: PlanOptions,
                 shares: Sequence[float] | None) -> Schedule:
    """One plan per input shape, smallest (by the unplanned peak) first; the schedule's own fields
    are the largest shape's, so that a reader that knows one shape sees the worst case."""
    check_shapes(profiles)
    if shares is not None and (len(shares) != len(profiles) or not all(math.isfinite(w) and w >= 0 for w in shares)
                               or not sum(shares)):
        raise MemfitError(f"shares: {len(profiles)} non-negative numbers, one per profile, not all 0; got {shares}")
    plans: list[Schedule] = []
    short: list[tuple[Profile, InfeasibleBudgetError]] = []
    for prof in profiles:
        try:
            plans.append(_plan_one(prof, budget, opts))
        except InfeasibleBudgetError as exc:
            short.append((prof, exc))
    if short:
        least = max(exc.min_budget_bytes or 0 for _, exc in short)
        raise InfeasibleBudgetError(
            f"no schedule fits {format_bytes(parse_bytes(budget))} for inputs "
            f"{' and '.join(p.input_shapes for p, _ in short)}: the smallest budget that works for every planned "
            f"shape is {format_bytes(least)} ({least} bytes); raise the budget, or plan for shorter inputs", least)
    for k, sched in enumerate(plans):
        sched.share = None if shares is None else shares[k] / sum(shares)
    order = sorted(range(len(plans)), key=lambda k: (predict(profiles[k], {}).peak_bytes, k))
    ordered = [plans[k] for k in order]
    return dataclasses.replace(ordered[-1], shapes=ordered)


def check_shapes(profiles: list[Profile]) -> None:
    """Profiles one schedule can hold: one model, one step, one device, each input shape once."""
    if not profiles:
        raise MemfitError("plan() needs a profile, or a list of profiles of one model at several input shapes")
    first = profiles[0]
    for prof in profiles[1:]:
        if any(prof.fingerprint.get(k) != first.fingerprint.get(k)
               for k in ("model_class", "units", "params_sha256", "hparams_sha256")):
            raise MemfitError("the profiles are of different models (their fingerprints differ): a schedule with "
                              "several input shapes is for one model; profile that model at each shape")
        setup = ("optimizer", "step", "device", "target", "parallel", "memory")
        if (differ := [k for k in setup if getattr(prof, k) != getattr(first, k)]):
            raise MemfitError(f"the profiles differ in {', '.join(differ)}, not only in input shape: profile each "
                              "shape with the same training step on the same device")
    seen: set[str] = set()
    for prof in profiles:
        if prof.input_shapes in seen:
            raise MemfitError(f"two profiles have the same inputs ({prof.input_shapes}); give each shape once")
        seen.add(prof.input_shapes)


def _choose(profile: Profile, budget_bytes: int, opts: PlanOptions, fine: bool,
            figures: dict[str, BaselineFigures] | None = None) -> tuple[Policies, str, str, str, float]:
    """(policies, strategy, solver, status, seconds) of the cheapest schedule of ``strategy``
    that fits. When the ILP's time limit passes with no answer, the cheapest fitting baseline
    stands in, and its strategy and status say so."""
    strategy, solver, max_segment = opts.strategy, opts.solver, opts.max_segment
    if strategy != "ilp":
        found = STRATEGIES[strategy](profile, budget_bytes)
        if found is None:
            raise _infeasible(budget_bytes, strategy_min_budget(profile, strategy), f" with strategy {strategy}")
        return found, strategy, strategy, "heuristic", 0.0
    model = IntModel.of(profile, segments=opts.segments, max_segment=max_segment, fine=fine)
    if solver == "dp" and not dp_exact(model):
        raise MemfitError("the dp solver is exact only when the units run as a chain, each keeps the same "
                          "memory after the step whatever its role and none frees an output a unit late (as "
                          "GPT-Neo's blocks do); these units do not: use cpsat or cbc")
    try:
        limit = opts.time_limit if opts.time_limit is not None or not fine else FINE_TIME_LIMIT
        sol = solve(model, budget_bytes, solver=solver, time_limit=limit, gap=FINE_GAP if fine else 0.0)
    except SolverTimeout:
        figures = figures if figures is not None else baselines(profile, budget_bytes)
        best = _cheapest_fitting(figures)
        if best is None:
            raise SolverTimeout(
                f"the {solver} solver found no answer within the time limit and no baseline fits "
                f"{format_bytes(budget_bytes)}; raise --time-limit"
            ) from None
        found = STRATEGIES[best](profile, budget_bytes)
        assert found is not None  # it fits: baselines() said so
        return found, best, best, f"time limit: no {solver} answer, best baseline ({best}) used", 0.0
    # The integer model rounds bytes up to its quantum (and CBC works in floating point), so at
    # the edges (a budget at or just below the unplanned peak) it can miss a schedule that fits
    # by predict(), the exact model. A fitting baseline that costs less stands in, and says so:
    # the ILP's answer is never worse than a baseline's. "Less" is by more than TIE_FRACTION of
    # the step: below that the two are a tie the integer model's rounded times cannot split.
    figures = figures if figures is not None else baselines(profile, budget_bytes)
    best = _cheapest_fitting(figures)
    found = None if sol is None else policies_of(profile.unit_names, sol.roles)
    if best is not None and (found is None or _weighed(figures[best]) + TIE_FRACTION * profile.step_s
                             < predict(profile, found).weighed_s):
        policies = STRATEGIES[best](profile, budget_bytes)
        assert policies is not None  # it fits: baselines() said so
        what = "found no schedule" if sol is None else "found a dearer one"
        return policies, strategy, solver, f"{solver} {what} (integer rounding); baseline {best} is cheaper", 0.0
    if found is None:
        least = min_budget_bytes(profile, solver=solver, segments=opts.segments, max_segment=max_segment, fine=fine)
        raise _infeasible(budget_bytes, least, "") if least > budget_bytes else MemfitError(
            f"the {solver} solver found no schedule within {format_bytes(budget_bytes)}, though the smallest budget "
            f"is {format_bytes(least)}: try --solver cpsat")
    assert sol is not None
    return found, strategy, solver, sol.status, sol.seconds


def _against_module(profile: Profile, budget_bytes: int, opts: PlanOptions, figures: dict[str, BaselineFigures],
                    policies: Policies, status: str) -> tuple[Policies, str]:
    """The fine plan against the module-level one: the cheaper as the planner weighs costs
    (roles.weighed; the module plan where it is as cheap: a fine solve stops at its gap or time
    limit). A gain within the uncertainty of the difference (the two plans' uncertainties in
    quadrature) is said, not refused: measured, the fine plan was the faster in every row where
    the two differed (docs/strategies.md, "Fine or module")."""
    try:
        coarse = _choose(profile, budget_bytes, opts, False, figures)[0]
    except (InfeasibleBudgetError, SolverTimeout):
        return policies, status
    if coarse == policies:
        return policies, status
    f, m = predict(profile, policies), predict(profile, coarse)
    if m.weighed_s <= f.weighed_s:
        return coarse, f"{status}; the module-level plan is as cheap: used"
    noise = math.hypot(f.uncertainty_s, m.uncertainty_s)  # two standard errors of the difference
    if noise <= 0 or m.recompute_s - f.recompute_s > noise:
        return policies, status
    return policies, (f"{status}; the fine plan's predicted recompute is {(f.recompute_s - m.recompute_s) * 1e3:+.1f} "
                      f"ms against the module-level plan's, within the costs' noise of {noise * 1e3:.1f} ms")


def _fallbacks(profile: Profile, peak: int, opts: PlanOptions, fine: bool) -> list[Fallback]:
    """Up to ``opts.fallbacks`` plans with ever lower predicted peaks, the last at the smallest feasible."""
    count = opts.fallbacks
    if count == 0:
        return []
    if opts.strategy == "ilp":
        least = min_budget_bytes(profile, solver=opts.solver, segments=opts.segments, max_segment=opts.max_segment,
                                 fine=fine)
    else:
        least = strategy_min_budget(profile, opts.strategy)
    ladder: list[Fallback] = []
    for i in range(1, count + 1):
        above = ladder[-1]["predicted_peak_bytes"] if ladder else peak
        cap = min(peak - (peak - least) * i // count, above - 1)
        if cap < least:
            break
        policies = _choose(profile, cap, opts, fine)[0]
        p = predict(profile, policies)
        ladder.append(Fallback(budget_bytes=cap, policies=policies, predicted_peak_bytes=p.peak_bytes,
                               predicted_recompute_s=p.recompute_s, predicted_overhead=p.overhead))
    return ladder


def baselines(profile: Profile, budget_bytes: int) -> dict[str, BaselineFigures]:
    """Every baseline strategy at this budget: whether it applies to the model at all and fits,
    and the predicted peak, recompute time and overhead of the schedule it uses, or when it
    does not fit, of its tightest schedule (the least peak it can reach)."""
    out: dict[str, BaselineFigures] = {}
    for name, baseline in BASELINES.items():
        if not_applicable(profile, name):
            out[name] = BaselineFigures(applies=False, fits=False)
            continue
        _, predictions = predicted(baseline, profile)
        k = pick(baseline, predictions, budget_bytes)
        fits = k is not None
        if k is None:
            k = min(range(len(predictions)), key=lambda i: (predictions[i].peak_bytes, predictions[i].recompute_s))
        p = predictions[k]
        out[name] = BaselineFigures(applies=True, fits=fits, peak_bytes=p.peak_bytes, recompute_s=p.recompute_s,
                                    overhead=p.overhead,
                                    **({"uncertainty_s": p.uncertainty_s} if p.uncertainty_s else {}))
    return out


def best_baseline(schedule: Schedule) -> str | None:
    """The fitting baseline with the least recompute time."""
    return _cheapest_fitting(schedule.baselines)


def _cheapest_fitting(figures: dict[str, dict[str, Any]]) -> str | None:
    fitting = {k: v for k, v in figures.items() if v.get("fits")}
    return min(fitting, key=lambda k: _weighed(fitting[k]), default=None)


def _weighed(figures: dict[str, Any]) -> float:
    """A baseline's cost as the planner weighs it (roles.weighed)."""
    return weighed(figures["recompute_s"], figures.get("uncertainty_s", 0.0))


def strategy_min_budget(profile: Profile, strategy: str) -> int:
    """The smallest budget a baseline strategy fits (they fit every larger budget too)."""
    full_peak = predict(profile, dict.fromkeys(profile.unit_names, FULL)).peak_bytes
    none_peak = predict(profile, {}).peak_bytes
    lo = full_peak // 2
    hi = max(none_peak, 2 * lo + 1)
    if STRATEGIES[strategy](profile, hi) is None:
        hi = max(full_peak, none_peak) * 4
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if STRATEGIES[strategy](profile, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _infeasible(budget: int, least: int, how: str) -> InfeasibleBudgetError:
    asked = format_bytes(budget)
    if asked == format_bytes(least):
        asked += f" ({budget} bytes)"
    return InfeasibleBudgetError(
        f"no schedule fits {asked}{how}: the smallest budget that works for this model and input "
        f"is {format_bytes(least)} ({least} bytes); raise the budget, or lower the batch size or sequence length",
        least,
    )


__all__ = ["Policies", "baselines", "best_baseline", "min_budget_bytes", "plan"]
