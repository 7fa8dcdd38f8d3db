"""sweep(): the plan of every strategy at many budgets, as one table: the memory-vs-slowdown curve.

Consecutive budgets share most of their answer, so nothing is solved cold per budget. For the
ILP on a chain, one frontier DP (frontier.py) yields the optimum at every budget at once; on
other units, budgets are solved from the largest down and a plan optimal at budget b is reused
for every smaller budget down to its own peak (it fits there, and nothing cheaper fits a
smaller budget); so also on chains where a unit's net change depends on its role, which the DP
cannot represent exactly. Each baseline's candidate schedules are predicted once and picked per budget.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memfit.budget import parse_bytes
from memfit.errors import InternalError, MemfitError
from memfit.formats.profile import Profile
from memfit.planning.baselines import BASELINES, Policies, not_applicable, pick, predicted
from memfit.planning.dp import dp_exact
from memfit.planning.frontier import chain_frontier, read
from memfit.planning.ilp import solve
from memfit.planning.intmodel import IntModel
from memfit.planning.options import PlanOptions, check_strategies, settle
from memfit.planning.peak import Prediction, predict
from memfit.planning.planner import check_granularity, min_budget_bytes
from memfit.planning.roles import policies_of, weighed
from memfit.policy import KEEP, spelt

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_STRATEGIES = ("ilp", "full", "every-k", "sqrt", "first-k", "greedy")
COLUMNS = {  # name -> pandas dtype
    "budget_bytes": "int64",
    "strategy": "string",
    "status": "string",  # optimal, feasible, heuristic, infeasible or n/a
    "predicted_peak_bytes": "Int64",  # missing where nothing fits
    "predicted_overhead": "float64",
    "recompute_s": "float64",
    "predicted_uncertainty": "float64",  # of predicted_overhead: two standard errors, from the profile's rounds
    "checkpointed": "Int64",
    "policies": "string",  # JSON of unit -> policy; empty where nothing fits
    "solve_s": "float64",  # seconds this row took (a shared frontier's time is split over its rows)
    "frontier_violation": "boolean",  # ILP only: a smaller budget was cheaper (a bug if ever true)
}


def default_budgets(profile: Profile, points: int = 30, options: PlanOptions | None = None) -> list[int]:
    """``points`` budgets, evenly spaced from the smallest feasible peak (planned with ``options``'
    segments and granularity) to the peak with nothing checkpointed."""
    if points < 2:
        raise MemfitError(f"a sweep needs at least 2 points, got {points}")
    opts = options or PlanOptions()
    fine = check_granularity(profile, opts.granularity)
    segments, max_segment = opts.segments, opts.max_segment
    model = IntModel.of(profile, segments=segments, max_segment=max_segment, fine=fine)
    solver = "dp" if dp_exact(model) else "cpsat"  # the same minimum; the DP is quicker
    lo = min_budget_bytes(profile, solver=solver, segments=segments, max_segment=max_segment, fine=fine)
    hi = max(lo, predict(profile, {}).peak_bytes)
    return sorted({lo + (hi - lo) * k // (points - 1) for k in range(points)})


def sweep(
    profile: Profile,
    budgets: Sequence[int | str] | None = None,
    options: PlanOptions | None = None,
    *,
    points: int = 30,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    solver: str | None = None,
    segments: bool | None = None,
    max_segment: int | None = None,
    granularity: str | None = None,
) -> pd.DataFrame:
    """One row per (budget, strategy): status, predicted peak and overhead, recompute time,
    units checkpointed, the policies as JSON and the solve time (columns: ``COLUMNS``).

    ``budgets`` are bytes or sizes such as ``"300MB"``; by default ``points`` budgets from the
    smallest feasible peak to the un-checkpointed peak. ``solver`` is used for units that are
    not a chain (on a chain the frontier DP gives the same optimum for every budget at once).
    ``granularity="fine"`` lets the ILP take the finer options of a fine profile (as ``plan``).
    The settings are one ``memfit.PlanOptions`` as in ``plan`` (``options``, with keywords put in;
    its strategy, time limit and fallbacks are not used here).
    """
    import pandas as pd

    strategies = check_strategies(strategies)
    opts = settle(options, solver=solver, segments=segments, max_segment=max_segment, granularity=granularity)
    fine = check_granularity(profile, opts.granularity)
    if budgets is None:
        sizes = default_budgets(profile, points, opts)
    else:
        sizes = sorted({parse_bytes(b) for b in budgets})
        if not sizes:
            raise MemfitError("no budgets to sweep")
    rows: list[dict[str, Any]] = []
    for strategy in dict.fromkeys(strategies):
        if strategy == "ilp":
            rows += _ilp_rows(profile, sizes, opts, fine)
        else:
            rows += _baseline_rows(profile, sizes, strategy)
    frame = pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)  # rows: by strategy as given, budget
    return frame


def _row(budget: int, strategy: str, status: str, policies: Policies | None, pred: Prediction | None,
         seconds: float) -> dict[str, Any]:
    """One row; ``pred`` is ``predict(profile, policies)``, made once per distinct plan."""
    if policies is None or pred is None:
        return {"budget_bytes": budget, "strategy": strategy, "status": status, "predicted_peak_bytes": None,
                "predicted_overhead": math.nan, "recompute_s": math.nan, "predicted_uncertainty": math.nan,
                "checkpointed": None, "policies": "",
                "solve_s": seconds, "frontier_violation": False}
    if pred.peak_bytes > budget:  # the scaled models round up, so this is a bug if it happens
        raise InternalError(f"{strategy} at {budget} bytes predicts {pred.peak_bytes}; please report this with the "
                            "profile")
    return {"budget_bytes": budget, "strategy": strategy, "status": status, "predicted_peak_bytes": pred.peak_bytes,
            "predicted_overhead": pred.overhead, "recompute_s": pred.recompute_s,
            "predicted_uncertainty": pred.overhead_uncertainty,
            "checkpointed": sum(v != KEEP for v in policies.values()), "policies": json.dumps(spelt(policies)),
            "solve_s": seconds, "frontier_violation": False}


def _baseline_rows(profile: Profile, sizes: list[int], strategy: str) -> list[dict[str, Any]]:
    if not_applicable(profile, strategy):
        return [_row(b, strategy, "n/a", None, None, 0.0) for b in sizes]
    start = time.perf_counter()
    baseline = BASELINES[strategy]
    candidates, predictions = predicted(baseline, profile)
    share = (time.perf_counter() - start) / len(sizes)
    rows = []
    for b in sizes:
        k = pick(baseline, predictions, b)
        if k is None:
            rows.append(_row(b, strategy, "infeasible", None, None, share))
        else:
            rows.append(_row(b, strategy, "heuristic", candidates[k], predictions[k], share))
    return rows


def _ilp_rows(profile: Profile, sizes: list[int], opts: PlanOptions, fine: bool) -> list[dict[str, Any]]:
    start = time.perf_counter()
    model = IntModel.of(profile, segments=opts.segments, max_segment=opts.max_segment, fine=fine)
    # The DP gives each unit one net change whatever its role; where a profile's differ (a unit
    # whose output outlives it, see profiler._share_outputs) it would be cautious, so the ILP decides.
    points = chain_frontier(model, [b // model.quantum for b in sizes]) if dp_exact(model) else None
    found: dict[int, tuple[str, Policies | None, Prediction | None]] = {}
    if points is None:
        found = _walk_down(profile, model, sizes, opts.solver)
    else:
        plans: dict[int, tuple[str, Policies, Prediction]] = {}  # by frontier point: budgets share plans
        for b in sizes:
            point = read(points, b // model.quantum)
            if point is None:
                found[b] = ("infeasible", None, None)
            else:
                if id(point) not in plans:
                    policies = policies_of(profile.unit_names, point.roles)
                    plans[id(point)] = ("optimal", policies, predict(profile, policies))
                found[b] = plans[id(point)]
    share = (time.perf_counter() - start) / len(sizes)
    rows = [_row(b, "ilp", *found[b], share) for b in sizes]
    _flag_violations(rows, profile.step_s)
    return rows


def _walk_down(profile: Profile, model: IntModel, sizes: list[int],
               solver: str) -> dict[int, tuple[str, Policies | None, Prediction | None]]:
    found: dict[int, tuple[str, Policies | None, Prediction | None]] = {}
    current: tuple[str, Policies, Prediction] | None = None  # status, plan, its prediction
    for b in sorted(sizes, reverse=True):
        if current is not None and current[2].peak_bytes <= b:
            found[b] = current
            continue
        sol = solve(model, b, solver=solver)
        if sol is None:
            for rest in (s for s in sizes if s <= b):
                found[rest] = ("infeasible", None, None)
            break
        plan = policies_of(profile.unit_names, sol.roles)
        current = found[b] = (sol.status, plan, predict(profile, plan))
    return found


def _flag_violations(rows: list[dict[str, Any]], step_s: float) -> None:
    """Mark each budget whose ILP cost, as the planner weighs it (roles.weighed), exceeds that of
    a smaller budget: the optimum of a larger budget can never be dearer, so such a row is a bug,
    shown rather than hidden."""
    cheapest_below = math.inf
    for row in rows:  # rows by rising budget
        cost = weighed(row["recompute_s"], row["predicted_uncertainty"] * step_s)
        if math.isnan(cost):
            continue
        row["frontier_violation"] = cost > cheapest_below + 1e-12
        cheapest_below = min(cheapest_below, cost)
