"""The ILP finds the true optimum of the memory model: CP-SAT == CBC == brute force."""

import itertools
import random

import pytest

import memfit
from memfit.optimizer.ilp import IntModel, solve
from memfit.optimizer.planner import min_budget_bytes

from .conftest import random_profile


def brute_force(profile, budget):
    """Least recompute over all 2^N assignments under predict(), or None if none fits."""
    best = None
    for combo in itertools.product(("none", "full"), repeat=len(profile.units)):
        pred = memfit.predict(profile, dict(zip(profile.unit_names, combo, strict=True)))
        if pred.peak_bytes <= budget and (best is None or pred.recompute_s < best[0] - 1e-15):
            best = (pred.recompute_s, combo)
    return best


def brute_min_peak(profile):
    return min(
        memfit.predict(profile, dict(zip(profile.unit_names, combo, strict=True))).peak_bytes
        for combo in itertools.product(("none", "full"), repeat=len(profile.units))
    )


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force(seed):
    n = 4 + seed % 9  # 4..12 units
    prof = random_profile(n, seed)
    assert IntModel.of(prof).quantum == 1  # small integers: the scaled model is exact
    lo, hi = brute_min_peak(prof), memfit.predict(prof, {}).peak_bytes
    assert min_budget_bytes(prof) == lo
    rng = random.Random(seed)
    for budget in [lo, hi, *(rng.randint(lo, hi) for _ in range(3))]:
        expected = brute_force(prof, budget)
        for solver in ("cpsat", "cbc"):
            sched = memfit.plan(prof, budget, solver=solver)
            assert sched.solver_status == "optimal"
            assert sched.predicted_peak_bytes <= budget
            assert sched.predicted_recompute_s == pytest.approx(expected[0], abs=1e-12)
    with pytest.raises(memfit.InfeasibleBudgetError):
        memfit.plan(prof, lo - 1)


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_equals_cbc_on_larger_chains(seed):
    prof = random_profile(40, 100 + seed)
    model = IntModel.of(prof)
    lo = solve(model, None, minimize="peak").objective
    assert solve(model, None, solver="cbc", minimize="peak").objective == lo
    hi = memfit.predict(prof, {}).peak_bytes
    for frac in (0.1, 0.4, 0.7):
        budget = int(lo + frac * (hi - lo))
        a = solve(model, budget, solver="cpsat")
        b = solve(model, budget, solver="cbc")
        assert a.objective == b.objective
        for sol in (a, b):
            pred = memfit.predict(prof, dict(zip(prof.unit_names, sol.choice, strict=True)))
            assert pred.peak_bytes <= budget


def test_infeasible_budget_names_the_minimum(gpt_profile):
    least = min_budget_bytes(gpt_profile)
    with pytest.raises(memfit.InfeasibleBudgetError) as info:
        memfit.plan(gpt_profile, least - 1)
    assert info.value.min_budget_bytes == least
    assert memfit.format_bytes(least) in str(info.value)
    assert "smallest budget" in str(info.value)
    sched = memfit.plan(gpt_profile, least)
    assert sched.predicted_peak_bytes <= least


def test_plan_records_baselines_and_recheck(gpt_profile):
    none = memfit.predict(gpt_profile, {}).peak_bytes
    full = memfit.predict(gpt_profile, dict.fromkeys(gpt_profile.unit_names, "full")).peak_bytes
    sched = memfit.plan(gpt_profile, (none + full) // 2)
    assert sched.baselines["none"]["peak_bytes"] == none
    assert sched.baselines["full"]["peak_bytes"] == full
    assert sched.predicted_peak_bytes == memfit.predict(gpt_profile, sched.policies).peak_bytes
    assert 0 < sched.predicted_recompute_s < sched.baselines["full"]["recompute_s"]
    assert memfit.plan(gpt_profile, none).checkpointed == []


def test_same_profile_same_schedule(gpt_profile, tmp_path):
    budget = (memfit.predict(gpt_profile, {}).peak_bytes + min_budget_bytes(gpt_profile)) // 2
    texts = []
    for i in range(2):
        s = memfit.plan(gpt_profile, budget)
        s.solve_s = 0.0
        s.save(tmp_path / f"s{i}.json")
        texts.append((tmp_path / f"s{i}.json").read_text())
    assert texts[0] == texts[1]


def test_bad_solver_and_granularity(gpt_profile):
    with pytest.raises(memfit.MemfitError, match="solver"):
        memfit.plan(gpt_profile, "1GB", solver="gurobi")
    with pytest.raises(memfit.MemfitError, match="granularity"):
        memfit.plan(gpt_profile, "1GB", granularity="op")
