"""plan(): the cheapest schedule that fits a budget, re-checked with predict() before it is returned."""

from __future__ import annotations

from memfit.budget import format_bytes, parse_bytes
from memfit.errors import InfeasibleBudgetError, MemfitError
from memfit.optimizer.ilp import IntModel, solve
from memfit.optimizer.model import Prediction, predict
from memfit.profile import Profile
from memfit.schedule import Schedule

GRANULARITIES = ("module",)


def baseline_policies(profile: Profile) -> dict[str, dict[str, str]]:
    """The schedules people use without a planner: checkpoint nothing, checkpoint everything."""
    return {
        "none": dict.fromkeys(profile.unit_names, "none"),
        "full": dict.fromkeys(profile.unit_names, "full"),
    }


def min_budget_bytes(profile: Profile, *, solver: str = "cpsat") -> int:
    """The smallest budget ``plan`` accepts for this profile."""
    model = IntModel.of(profile)
    sol = solve(model, None, solver=solver, minimize="peak")
    if sol is None:  # pragma: no cover - minimising the peak always has an answer
        raise MemfitError("the solver found no schedule at all")
    return sol.objective * model.quantum


def plan(
    profile: Profile,
    budget: str | int,
    *,
    solver: str = "cpsat",
    granularity: str = "module",
    time_limit: float | None = None,
) -> Schedule:
    """The schedule with the least recompute time whose predicted peak fits ``budget``.

    ``budget`` is bytes or a size such as ``"24GB"`` (binary units). Raises
    ``InfeasibleBudgetError`` with the smallest workable budget when nothing fits.
    """
    if granularity not in GRANULARITIES:
        raise MemfitError(f"unknown granularity {granularity!r}; use one of {', '.join(GRANULARITIES)}")
    budget_bytes = parse_bytes(budget)
    model = IntModel.of(profile)
    sol = solve(model, budget_bytes, solver=solver, time_limit=time_limit)
    if sol is None:
        least = min_budget_bytes(profile, solver=solver)
        raise InfeasibleBudgetError(
            f"no schedule fits {format_bytes(budget_bytes)}: the smallest budget that works for this "
            f"model and input is {format_bytes(least)} ({least} bytes); raise the budget, or lower "
            "the batch size or sequence length",
            least,
        )
    policies = dict(zip(profile.unit_names, sol.choice, strict=True))
    pred = predict(profile, policies)
    if pred.peak_bytes > budget_bytes:  # the scaled model rounds up, so this is a bug if it happens
        raise MemfitError(
            f"internal check failed: the solver's schedule predicts {pred.peak_bytes} bytes, over the "
            f"budget of {budget_bytes}; please report this with the profile"
        )
    return Schedule(
        policies=policies,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_recompute_s=pred.recompute_s,
        predicted_overhead=pred.overhead,
        strategy="ilp",
        solver=solver,
        solver_status=sol.status,
        solve_s=sol.seconds,
        fingerprint=dict(profile.fingerprint),
        input_shapes=profile.input_shapes,
        baselines={name: _summary(predict(profile, pol)) for name, pol in baseline_policies(profile).items()},
    )


def _summary(pred: Prediction) -> dict[str, float]:
    return {"peak_bytes": pred.peak_bytes, "recompute_s": pred.recompute_s, "overhead": pred.overhead}
