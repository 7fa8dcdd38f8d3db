"""The integer program: one role per unit, one constraint per phase, least recompute time.

Every solver (OR-Tools CP-SAT, PuLP with CBC, and the chain DP in dp.py) works on the same
integer data, ``intmodel.IntModel``. Levels are sums carried by a few variables, which keeps
the model linear in size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from memfit.errors import MemfitError, SolverTimeout
from memfit.planning import SOLVERS
from memfit.planning.dp import solve_dp
from memfit.planning.intmodel import RANGE, IntModel, Layout, chain_layout
from memfit.planning.roles import FULL, Role


@dataclass(slots=True)
class Solution:
    roles: list[Role]  # per unit
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
    gap: float = 0.0,
) -> Solution | None:
    """Least recompute under ``budget_bytes`` (``minimize="recompute"``), or the least peak
    (``minimize="peak"``, budget ignored). ``None`` when no choice fits. ``gap``: stop once the
    answer is proven within this fraction of the optimum (the status then says how close)."""
    if solver not in SOLVERS:
        raise MemfitError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    cap = None if budget_bytes is None or minimize == "peak" else budget_bytes // model.quantum
    if cap is not None:
        cap = min(cap, 4 * RANGE)  # scaled levels stay below RANGE: a larger budget changes nothing
    start = time.perf_counter()
    if solver == "dp":
        result = solve_dp(model, cap, minimize)
    else:
        result = _solve_mip(model, cap, minimize, time_limit, solver, gap)
    if result is None:
        return None
    roles, status, objective = result
    return Solution(roles, status, time.perf_counter() - start, objective)


def _segments(model: IntModel) -> list[Role]:
    return sorted({r for rs in model.roles for r in rs if r.is_segment}, key=lambda r: (r.first, r.last))


def _solve_mip(
    model: IntModel, cap: int | None, minimize: str, time_limit: float | None, solver: str, gap: float = 0.0
) -> tuple[list[Role], str, int] | None:
    """CP-SAT and CBC share this formulation; ``_CpSat`` and ``_Cbc`` hide their spelling."""
    b = _CpSat() if solver == "cpsat" else _Cbc()
    x = [{r: b.boolean(f"o{j}_{k}") for k, r in enumerate(model.roles[j]) if not r.is_segment} for j in range(model.n)]
    for seg in _segments(model):
        var = b.boolean(f"s{seg.first}_{seg.last}")
        b.hint(var, 0)
        for j in range(seg.first, seg.last + 1):
            x[j][seg] = var
    for j in range(model.n):
        b.add_eq(list(x[j].values()), 1)
        for role, var in x[j].items():  # checkpointing every unit usually fits: a first answer to improve
            if not role.is_segment:
                b.hint(var, int(role == FULL))
    any_ckpt = b.boolean("any_ckpt")  # some unit holds outside tensors (IntCosts.holds): exactly the OR of those roles
    checkpointed = [var for j in range(model.n) for role, var in x[j].items() if model.costs[j, role].holds]
    for var in checkpointed:
        b.add_implies(var, any_ckpt)
    b.add_le(b.expr([(1, any_ckpt)] + [(-1, v) for v in checkpointed]), 0)
    b.hint(any_ckpt, 1)
    big = model.baseline + sum(abs(v) for c in model.costs.values() for v in c) + sum(
        abs(p.peak) + abs(p.ckpt_peak) + abs(p.end) + abs(p.ckpt_end) for p in model.phases) + 1
    lay = chain_layout(model)
    if lay is not None:
        peaks = _anchored_peaks(b, model, x, any_ckpt, lay, big)
    else:
        peaks = _chained_peaks(b, model, x, any_ckpt, big)
    peak_var = b.integer(-big, big, "peak") if minimize == "peak" else None
    for e in peaks:
        if peak_var is not None:
            b.add_le(e - peak_var, 0)
        elif cap is not None:
            b.add_le(e, cap)
    if peak_var is not None:
        b.minimize(b.expr([(1, peak_var)]))
    else:
        b.minimize(b.expr([(model.recompute_ns[j, r], v) for j in range(model.n) for r, v in x[j].items()]))
    outcome = b.solve(time_limit, gap)
    if outcome is None:
        return None
    status, objective = outcome
    roles = [next(r for r, v in x[j].items() if b.value(v)) for j in range(model.n)]
    return roles, status, objective


def _chained_peaks(b, model: IntModel, x, any_ckpt, big: int) -> list:  # type: ignore[no-untyped-def]
    """Any timeline: a level variable after every phase (level after = level before + end)."""
    peaks = []
    level = b.expr([], model.baseline)
    for k, ph in enumerate(model.phases):
        if ph.unit is None:
            peak = level + b.expr([(ph.ckpt_peak - ph.peak, any_ckpt)], ph.peak)
            if ph.after is not None:
                peak = peak + b.expr([(model.costs[ph.after, r].after_peak, v) for r, v in x[ph.after].items()])
            peaks.append(peak)
            end_expr = level + ph.end + b.expr([(ph.ckpt_end - ph.end, any_ckpt)])
            if ph.releases:
                end_expr = end_expr - b.expr([(model.costs[j, r].release, v) for j in range(model.n)
                                              for r, v in x[j].items()])
            if ph.after is not None:  # the unit just run frees its freed, the one before it its later
                end_expr = end_expr - b.expr([(model.costs[ph.after, r].freed, v) for r, v in x[ph.after].items()])
                if ph.after > 0:
                    end_expr = end_expr - b.expr([(model.costs[ph.after - 1, r].later, v)
                                                  for r, v in x[ph.after - 1].items()])
        else:
            fwd, costs = ph.kind == "forward", [(model.costs[ph.unit, r], v) for r, v in x[ph.unit].items()]
            moves = [((c.fwd_peak, c.fwd_end) if fwd else c.backward(ph.later), v) for c, v in costs]
            peaks.append(level + b.expr([(peak, v) for (peak, _), v in moves]))
            end_expr = level + b.expr([(end, v) for (_, end), v in moves])
        nxt = b.integer(-big, big, f"L{k}")
        b.add_le(end_expr - nxt, 0)  # the level may only be over-estimated, never under
        level = b.expr([(1, nxt)])
    return peaks


def _anchored_peaks(b, model: IntModel, x, any_ckpt, lay: Layout, big: int) -> list:  # type: ignore[no-untyped-def]
    """A chain: two variables per unit, the bytes the forward has kept so far (P) and the net
    change of the units after it (Q). Every phase's level is a constant plus one P, one Q and
    the unit's own terms: far fewer and smaller constraints than a level per phase."""
    n = model.n
    r0, r1 = [0], [0]  # remainder bytes added before each phase, without / with checkpointing
    for p in model.phases:
        r0.append(r0[-1] + (p.end if p.unit is None else 0))
        r1.append(r1[-1] + (p.ckpt_end if p.unit is None else 0))

    def at(t: int, const: int):  # type: ignore[no-untyped-def]
        return b.expr([(r1[t] - r0[t], any_ckpt)], model.baseline + r0[t] + const)

    def rest(t: int):  # type: ignore[no-untyped-def]  # remainder t's peak
        p = model.phases[t]
        return b.expr([(r1[t] - r0[t] + p.ckpt_peak - p.peak, any_ckpt)], model.baseline + r0[t] + p.peak)

    def unit(j: int, field: str):  # type: ignore[no-untyped-def]
        return b.expr([(getattr(model.costs[j, r], field), v) for r, v in x[j].items()])

    def net(j: int):  # type: ignore[no-untyped-def]
        return b.expr([(model.costs[j, r].net, v) for r, v in x[j].items()])

    def late(j: int):  # type: ignore[no-untyped-def]  # what unit j - 1 frees after unit j's forward
        return unit(j - 1, "later") if j > 0 else b.expr([], 0)

    kept, after = [b.expr([], 0)], [b.expr([], 0)] * (n + 1)
    hinted = 0
    for j in range(n):  # may only be over-estimated, as every level
        v = b.integer(-big, big, f"P{j}")
        b.add_le(kept[j] + unit(j, "fwd_end") - unit(j, "freed") - late(j) - v, 0)  # freed by the remainder after it
        hinted += model.costs[j, FULL].fwd_end - model.costs[j, FULL].freed - (
            model.costs[j - 1, FULL].later if j > 0 else 0)
        b.hint(v, hinted)  # its value when every unit is checkpointed (the hinted roles)
        kept.append(b.expr([(1, v)]))
    for j in reversed(range(n)):
        v = b.integer(-big, big, f"Q{j}")
        b.add_le(after[j + 1] + net(j) - v, 0)
        after[j] = b.expr([(1, v)])
    peaks = [rest(t) for t in lay.pre]
    for j in range(n):
        peaks.append(at(lay.fwd[j], 0) + kept[j] + unit(j, "fwd_peak"))
        peaks += [rest(t) + kept[j + 1] + (unit(j, "freed") + late(j) + unit(j, "after_peak")
                                                               if k == 0 else 0)
                  for k, t in enumerate(lay.after_fwd[j])]  # the first frees them only at its end
        # by unit j's backward every later unit's forward has run: its own later is gone too (the
        # units after it have theirs in their nets)
        peaks.append(at(lay.bwd[j], 0) + kept[j + 1] + after[j + 1] - unit(j, "later") + unit(j, "bwd_peak"))
        peaks += [rest(t) + kept[j + 1] + after[j + 1] - unit(j, "later") + unit(j, "bwd_end")
                  for t in lay.after_bwd[j]]
    return peaks


class _CpSat:
    def __init__(self) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.m = cp_model.CpModel()
        self.s = cp_model.CpSolver()

    def boolean(self, name: str):  # type: ignore[no-untyped-def]
        return self.m.NewBoolVar(name)

    def integer(self, lo: int, hi: int, name: str):  # type: ignore[no-untyped-def]
        return self.m.NewIntVar(lo, hi, name)

    def expr(self, terms, const: int = 0):  # type: ignore[no-untyped-def]
        return sum((c * v for c, v in terms if c), const)

    def add_eq(self, vars_, value: int) -> None:  # type: ignore[no-untyped-def]
        self.m.Add(sum(vars_) == value)

    def add_le(self, e, value: int) -> None:  # type: ignore[no-untyped-def]
        self.m.Add(e <= value)

    def add_implies(self, a, b) -> None:  # type: ignore[no-untyped-def]
        self.m.AddImplication(a, b)

    def hint(self, var, value: int) -> None:  # type: ignore[no-untyped-def]
        self.m.AddHint(var, value)

    def minimize(self, e) -> None:  # type: ignore[no-untyped-def]
        self.m.Minimize(e)

    def solve(self, time_limit: float | None, gap: float) -> tuple[str, int] | None:
        p = self.s.parameters
        p.num_workers = 1  # deterministic: the same profile gives the same schedule
        p.random_seed = 0
        if time_limit is not None:
            p.max_time_in_seconds = float(time_limit)
        if gap > 0:
            p.relative_gap_limit = gap
        status = self.s.Solve(self.m)
        if status == self.cp.UNKNOWN:
            raise SolverTimeout("the solver found no answer within the time limit; raise --time-limit")
        if status not in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            return None
        value = self.s.ObjectiveValue()
        off = (value - self.s.BestObjectiveBound()) / value if value else 0.0
        if status == self.cp.OPTIMAL:  # also where the gap limit stopped it: say how close
            return ("optimal" if off <= 0 else f"optimal within {off:.2%} (gap limit)"), round(value)
        return f"feasible (time limit; within {off:.1%} of optimal)", round(value)

    def value(self, v) -> bool:  # type: ignore[no-untyped-def]
        return bool(self.s.Value(v))


class _Cbc:
    def __init__(self) -> None:
        import pulp

        self.pulp = pulp
        self.prob = pulp.LpProblem("memfit", pulp.LpMinimize)

    def boolean(self, name: str):  # type: ignore[no-untyped-def]
        return self.pulp.LpVariable(name, cat="Binary")

    def integer(self, lo: int, hi: int, name: str):  # type: ignore[no-untyped-def]
        return self.pulp.LpVariable(name, lo, hi)

    def expr(self, terms, const: int = 0):  # type: ignore[no-untyped-def]
        e = self.pulp.LpAffineExpression(constant=const)
        for c, v in terms:  # a segment's variable recurs once per member: add, never overwrite
            if c:
                e.addterm(v, c)
        return e

    def add_eq(self, vars_, value: int) -> None:  # type: ignore[no-untyped-def]
        self.prob += self.pulp.lpSum(vars_) == value

    def add_le(self, e, value: int) -> None:  # type: ignore[no-untyped-def]
        self.prob += e <= value

    def add_implies(self, a, b) -> None:  # type: ignore[no-untyped-def]
        self.prob += b >= a

    def hint(self, var, value: int) -> None:  # type: ignore[no-untyped-def]
        pass  # CBC finds a first answer by itself quickly

    def minimize(self, e) -> None:  # type: ignore[no-untyped-def]
        self.prob.setObjective(e)

    def solve(self, time_limit: float | None, gap: float) -> tuple[str, int] | None:
        pulp = self.pulp
        # threads= is left unset on purpose: CBC sometimes waits ~10 s on its thread pool with it.
        self.prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap or None))
        if self.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            if pulp.LpStatus[self.prob.status] == "Not Solved":
                raise SolverTimeout("the solver found no answer within the time limit; raise --time-limit")
            return None
        optimal = self.prob.sol_status == pulp.LpSolutionOptimal
        return ("optimal" if optimal else "feasible"), round(pulp.value(self.prob.objective))

    def value(self, v) -> bool:  # type: ignore[no-untyped-def]
        return (v.value() or 0.0) > 0.5
