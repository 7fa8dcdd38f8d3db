"""The integer program: one option per unit, one constraint per phase, least recompute time.

Both backends (OR-Tools CP-SAT and PuLP with CBC) solve the same integer data: bytes divided by
a quantum and rounded up, so that whatever fits the scaled model fits the real one, and
recompute time in whole nanoseconds. Levels are chained variables (level after phase k = level
before it + the phase's end), which keeps the model linear in size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.profile import OPTIONS, Profile

SOLVERS = ("cpsat", "cbc")
_RANGE = 2**30  # scaled bytes stay below this, far inside both solvers' exact integer range


@dataclass(slots=True)
class IntModel:
    """A Profile in integers: per phase (peak, end) per option, per unit recompute ns."""

    quantum: int
    baseline: int
    # (unit, option -> (peak, end)); the remainder's options are "" and "ckpt" (some unit checkpointed)
    phases: list[tuple[int | None, dict[str, tuple[int, int]]]]
    recompute_ns: list[dict[str, int]]

    @staticmethod
    def of(profile: Profile) -> IntModel:
        scale = profile.baseline_bytes + sum(
            max(abs(p.peak_bytes), abs(p.end_bytes)) for p in profile.phases
        ) + sum(
            max(abs(v) for o in u.options.values() for v in (o.fwd_peak_bytes, o.stored_bytes,
                                                              o.bwd_peak_bytes, o.bwd_end_bytes))
            for u in profile.units
        )
        q = max(1, math.ceil(scale / _RANGE))

        def up(x: int) -> int:
            return -((-x) // q)

        phases: list[tuple[int | None, dict[str, tuple[int, int]]]] = []
        for ph in profile.phases:
            if ph.unit is None:
                peak = up(ph.peak_bytes)
                phases.append((None, {"": (peak, up(ph.end_bytes)), "ckpt": (peak, up(ph.ckpt_end_bytes))}))
                continue
            costs = profile.units[ph.unit].options
            if ph.kind == "forward":
                table = {o: (up(c.fwd_peak_bytes), up(c.stored_bytes)) for o, c in costs.items()}
            else:
                table = {o: (up(c.bwd_peak_bytes), up(c.bwd_end_bytes)) for o, c in costs.items()}
            phases.append((ph.unit, table))
        recompute = [{o: round(c.recompute_s * 1e9) for o, c in u.options.items()} for u in profile.units]
        return IntModel(q, up(profile.baseline_bytes), phases, recompute)


@dataclass(slots=True)
class Solution:
    choice: list[str]  # option per unit
    status: str  # "optimal" or "feasible" (time limit reached with an answer)
    seconds: float
    objective: int  # recompute ns, or scaled peak when minimising memory


def solve(
    model: IntModel,
    budget_bytes: int | None,
    *,
    solver: str = "cpsat",
    minimize: str = "recompute",
    time_limit: float | None = None,
) -> Solution | None:
    """Least recompute under ``budget_bytes`` (``minimize="recompute"``), or the least peak
    (``minimize="peak"``, budget ignored). ``None`` when no choice fits."""
    if solver not in SOLVERS:
        raise MemfitError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    cap = None if budget_bytes is None or minimize == "peak" else budget_bytes // model.quantum
    start = time.perf_counter()
    if solver == "cpsat":
        result = _solve_cpsat(model, cap, minimize, time_limit)
    else:
        result = _solve_cbc(model, cap, minimize, time_limit)
    if result is None:
        return None
    choice, status, objective = result
    return Solution(choice, status, time.perf_counter() - start, objective)


def _bounds(model: IntModel) -> int:
    return model.baseline + sum(max(abs(v) for pe in t.values() for v in pe) for _, t in model.phases) + 1


def _solve_cpsat(
    model: IntModel, cap: int | None, minimize: str, time_limit: float | None
) -> tuple[list[str], str, int] | None:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    n = len(model.recompute_ns)
    x = [{o: m.NewBoolVar(f"x{i}_{o}") for o in OPTIONS} for i in range(n)]
    for i in range(n):
        m.AddExactlyOne(x[i].values())
    big = _bounds(model)
    peak_var = m.NewIntVar(-big, big, "peak") if minimize == "peak" else None
    any_ckpt = m.NewBoolVar("any_ckpt")
    for i in range(n):
        for o in OPTIONS[1:]:
            m.AddImplication(x[i][o], any_ckpt)
    level: cp_model.LinearExprT = model.baseline
    for k, (unit, table) in enumerate(model.phases):
        if unit is None:
            p, e = table[""]
            peak_expr: cp_model.LinearExprT = level + p
            end_expr: cp_model.LinearExprT = level + e + (table["ckpt"][1] - e) * any_ckpt
        else:
            peak_expr = level + sum(table[o][0] * x[unit][o] for o in OPTIONS)
            end_expr = level + sum(table[o][1] * x[unit][o] for o in OPTIONS)
        if peak_var is not None:
            m.Add(peak_expr <= peak_var)
        elif cap is not None:
            m.Add(peak_expr <= cap)
        nxt = m.NewIntVar(-big, big, f"L{k}")
        m.Add(nxt == end_expr)
        level = nxt
    if peak_var is not None:
        m.Minimize(peak_var)
    else:
        m.Minimize(sum(model.recompute_ns[i][o] * x[i][o] for i in range(n) for o in OPTIONS))
    s = cp_model.CpSolver()
    s.parameters.num_workers = 1  # deterministic: the same profile gives the same schedule
    s.parameters.random_seed = 0
    if time_limit is not None:
        s.parameters.max_time_in_seconds = float(time_limit)
    status = s.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.UNKNOWN:
            raise MemfitError("the solver found no answer within the time limit; raise --time-limit")
        return None
    choice = [next(o for o in OPTIONS if s.Value(x[i][o])) for i in range(n)]
    return choice, "optimal" if status == cp_model.OPTIMAL else "feasible", round(s.ObjectiveValue())


def _solve_cbc(
    model: IntModel, cap: int | None, minimize: str, time_limit: float | None
) -> tuple[list[str], str, int] | None:
    import pulp

    prob = pulp.LpProblem("memfit", pulp.LpMinimize)
    n = len(model.recompute_ns)
    x = [{o: pulp.LpVariable(f"x{i}_{o}", cat="Binary") for o in OPTIONS} for i in range(n)]
    for i in range(n):
        prob += pulp.lpSum(x[i].values()) == 1
    peak_var = pulp.LpVariable("peak") if minimize == "peak" else None
    any_ckpt = pulp.LpVariable("any_ckpt", cat="Binary")
    for i in range(n):
        for o in OPTIONS[1:]:
            prob += any_ckpt >= x[i][o]
    if peak_var is not None:
        prob += peak_var
    else:
        prob += pulp.lpSum(model.recompute_ns[i][o] * x[i][o] for i in range(n) for o in OPTIONS)
    level: pulp.LpAffineExpression = pulp.LpAffineExpression(constant=model.baseline)
    for k, (unit, table) in enumerate(model.phases):
        if unit is None:
            p, e = table[""]
            peak_expr, end_expr = level + p, level + e + (table["ckpt"][1] - e) * any_ckpt
        else:
            peak_expr = level + pulp.lpSum(table[o][0] * x[unit][o] for o in OPTIONS)
            end_expr = level + pulp.lpSum(table[o][1] * x[unit][o] for o in OPTIONS)
        if peak_var is not None:
            prob += peak_expr <= peak_var
        elif cap is not None:
            prob += peak_expr <= cap
        nxt = pulp.LpVariable(f"L{k}")
        prob += nxt == end_expr
        level = nxt
    cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    prob.solve(cmd)
    status = pulp.LpStatus[prob.status]
    if status != "Optimal" or prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if status == "Not Solved":
            raise MemfitError("the solver found no answer within the time limit; raise --time-limit")
        return None
    choice = [max(OPTIONS, key=lambda o, i=i: x[i][o].value() or 0.0) for i in range(n)]
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return choice, "optimal" if optimal else "feasible", round(pulp.value(prob.objective))
