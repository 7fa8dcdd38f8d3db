"""The optimizer finds the true optimum of the memory model: CP-SAT == CBC == DP == brute force."""

import itertools
import random

import pytest

import memfit
from memfit import policy
from memfit.planning.dp import dp_exact
from memfit.planning.ilp import solve
from memfit.planning.intmodel import IntModel
from memfit.planning.planner import min_budget_bytes
from memfit.planning.roles import FULL, NONE, Role, segment

from .conftest import random_profile


def assignments(n, max_segment):
    """Every way to give n chained units roles: none, full, or segments of 2..max_segment."""
    if n == 0:
        yield []
        return
    for rest in assignments(n - 1, max_segment):
        yield [NONE, *[_shift(r, 1) for r in rest]]
        yield [FULL, *[_shift(r, 1) for r in rest]]
    for length in range(2, min(n, max_segment) + 1):
        for rest in assignments(n - length, max_segment):
            yield [segment(0, length - 1)] * length + [_shift(r, length) for r in rest]


def _shift(role, by):
    return Role(role.option, role.first + by, role.last + by) if role.is_segment else role


def brute_force(profile, budget, max_segment):
    """(least cost as the planner weighs it, least peak) over every assignment under predict():
    the recompute, plus one standard error where the options' costs carry an uncertainty."""
    best, least = None, None
    names = profile.unit_names
    for roles in assignments(len(names), max_segment if profile.chain else 1):
        pred = memfit.predict(profile, {n: r.policy(names) for n, r in zip(names, roles, strict=True)})
        least = pred.peak_bytes if least is None else min(least, pred.peak_bytes)
        if pred.peak_bytes <= budget and (best is None or pred.weighed_s < best - 1e-15):
            best = pred.weighed_s
    return best, least


def _unsure(prof, seed):
    """Give every option but none an uncertainty of 0 to 1 ms (whole microseconds twice over, so
    that one standard error is whole microseconds and the integer model stays exact)."""
    r = random.Random(seed + 7)
    for u in prof.units:
        for k, o in u.options.items():
            if k != policy.KEEP:
                o.recompute_uncertainty_s = 2 * r.randint(0, 500) * 1e-6
    return prof


@pytest.mark.parametrize("seed", range(10))
def test_optimum_equals_brute_force(seed):
    """Up to 12 units with none/full, up to 8 with segments too: every solver hits the optimum;
    on a third of the seeds a checkpointed unit lets the remainder after it free bytes."""
    chain = seed % 2 == 0
    n = 4 + seed % 5 if chain else 6 + seed % 7  # 4..8 chained, 6..12 without segments
    prof = random_profile(n, seed, chain=chain, frees=seed % 3 == 2)
    if seed % 4 >= 2:  # costs known to an uncertainty: the least recompute plus one standard error
        _unsure(prof, seed)
    assert any(u.options[policy.FULL].freed_after_bytes for u in prof.units) == (seed % 3 == 2)
    assert dp_exact(IntModel.of(prof))  # one net per unit, freed bytes counted
    assert IntModel.of(prof).quantum == 1  # small integers: the scaled model is exact
    hi = memfit.predict(prof, {}).peak_bytes
    _, lo = brute_force(prof, hi, 4)
    assert min_budget_bytes(prof, max_segment=4) == lo
    assert min_budget_bytes(prof, max_segment=4, solver="dp") == lo
    rng = random.Random(seed)
    for budget in [lo, hi, *(rng.randint(lo, hi) for _ in range(3))]:
        expected, _ = brute_force(prof, budget, 4)
        for solver in ("cpsat", "cbc", "dp"):
            sched = memfit.plan(prof, budget, solver=solver, max_segment=4)
            assert sched.solver_status == "optimal"
            assert sched.predicted_peak_bytes <= budget
            assert memfit.predict(prof, sched.policies).weighed_s == pytest.approx(expected, abs=1e-12), solver
    with pytest.raises(memfit.InfeasibleBudgetError):
        memfit.plan(prof, lo - 1, max_segment=4)


def _solvers_hit_brute_force(prof, seed: int, solvers: tuple[str, ...]) -> int:
    """Each of ``solvers`` at five budgets from the floor to the unplanned peak against the
    brute-force optimum over none/full and segments of up to 4; the floor too. Returns it."""
    hi = memfit.predict(prof, {}).peak_bytes
    _, lo = brute_force(prof, hi, 4)
    assert min_budget_bytes(prof, max_segment=4) == lo
    rng = random.Random(seed)
    for budget in [lo, hi, *(rng.randint(lo, hi) for _ in range(3))]:
        expected, _ = brute_force(prof, budget, 4)
        for solver in solvers:
            sched = memfit.plan(prof, budget, solver=solver, max_segment=4)
            assert sched.predicted_peak_bytes <= budget
            assert sched.predicted_recompute_s == pytest.approx(expected, abs=1e-12), (solver, budget)
    return lo


@pytest.mark.parametrize("seed", range(6))
def test_a_checkpoint_that_keeps_its_input_optimum_equals_brute_force(seed):
    """Checkpointed units that keep their input where the plain step frees it right after them
    (``freed_after_bytes`` negative: BERT's blocks under autocast): every solver hits the
    brute-force optimum over none/full (and segments on chains), the DP too."""
    chain = seed % 2 == 0
    n = 4 + seed % 4 if chain else 6 + seed % 5
    prof = random_profile(n, seed, chain=chain, keeps=True)
    assert all(u.options[policy.FULL].freed_after_bytes < 0 for u in prof.units[1:])
    model = IntModel.of(prof)
    assert model.quantum == 1 and dp_exact(model)  # one net per unit: the kept input goes with its backward
    _solvers_hit_brute_force(prof, seed, ("cpsat", "cbc", "dp"))


@pytest.mark.parametrize("seed", range(6))
def test_frees_a_unit_late_optimum_equals_brute_force(seed):
    """Checkpointed units whose loop holds an output until the next unit returns (GPT-Neo's
    attention probabilities: ``freed_later_bytes``): CP-SAT and CBC hit the brute-force optimum
    over none/full (and segments on chains, which never count the late free); the DP, whose walk
    does not subtract it, is not exact there and refuses, saying why."""
    chain = seed % 2 == 0
    n = 4 + seed % 4 if chain else 6 + seed % 5
    prof = random_profile(n, seed, chain=chain, frees=seed % 3 == 2, late=True)
    assert any(u.options[policy.FULL].freed_later_bytes for u in prof.units)
    model = IntModel.of(prof)
    assert model.quantum == 1 and not dp_exact(model)
    hi = memfit.predict(prof, {}).peak_bytes
    _solvers_hit_brute_force(prof, seed, ("cpsat", "cbc"))
    with pytest.raises(memfit.MemfitError, match="frees an output a unit late"):
        memfit.plan(prof, hi, solver="dp")


def test_segments_lower_the_floor():
    """On chains, segments reach budgets that per-unit checkpointing cannot."""
    gains = 0
    for seed in range(10):
        prof = random_profile(10, 200 + seed)
        with_seg = min_budget_bytes(prof)
        without = min_budget_bytes(prof, segments=False)
        assert with_seg <= without
        gains += with_seg < without
    assert gains > 0


@pytest.mark.parametrize("seed", range(5))
def test_cpsat_cbc_dp_agree_on_40_units(seed):
    prof = random_profile(40, 100 + seed)
    model = IntModel.of(prof, max_segment=6)
    lo = solve(model, None, minimize="peak").objective
    assert solve(model, None, solver="cbc", minimize="peak").objective == lo
    assert solve(model, None, solver="dp", minimize="peak").objective == lo
    hi = memfit.predict(prof, {}).peak_bytes
    for frac in (0.1, 0.4, 0.7):
        budget = int(lo + frac * (hi - lo))
        answers = [solve(model, budget, solver=s) for s in ("cpsat", "cbc", "dp")]
        assert len({a.objective for a in answers}) == 1
        for sol in answers:
            policies = {n: r.policy(prof.unit_names) for n, r in zip(prof.unit_names, sol.roles, strict=True)}
            assert memfit.predict(prof, policies).peak_bytes <= budget


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
    full = memfit.predict(gpt_profile, dict.fromkeys(gpt_profile.unit_names, policy.FULL)).peak_bytes
    sched = memfit.plan(gpt_profile, (none + full) // 2)
    assert sched.baselines["none"]["peak_bytes"] == none and not sched.baselines["none"]["fits"]
    assert sched.baselines["full"]["peak_bytes"] == full and sched.baselines["full"]["fits"]
    assert sched.predicted_peak_bytes == memfit.predict(gpt_profile, sched.policies).peak_bytes
    assert 0 < sched.predicted_recompute_s < sched.baselines["full"]["recompute_s"]
    for name, figures in sched.baselines.items():
        if figures["fits"]:
            assert sched.predicted_recompute_s <= figures["recompute_s"] + 1e-12, name
    assert memfit.plan(gpt_profile, none).checkpointed == []


def test_same_profile_same_schedule_file(gpt_profile, tmp_path):
    budget = (memfit.predict(gpt_profile, {}).peak_bytes + min_budget_bytes(gpt_profile)) // 2
    texts = []
    for i in range(2):
        memfit.plan(gpt_profile, budget).save(tmp_path / f"s{i}.json")
        texts.append((tmp_path / f"s{i}.json").read_bytes())
    assert texts[0] == texts[1]


def test_bad_solver_strategy_and_granularity(gpt_profile):
    with pytest.raises(memfit.MemfitError, match="solver"):
        memfit.plan(gpt_profile, "1GB", solver="gurobi")
    with pytest.raises(memfit.MemfitError, match="strategy"):
        memfit.plan(gpt_profile, "1GB", strategy="magic")
    with pytest.raises(memfit.MemfitError, match="granularity"):
        memfit.plan(gpt_profile, "1GB", granularity="op")


def test_timeline_that_is_not_a_chain():
    """Units whose backwards do not run in reverse order (two towers, say) use the general
    formulation with a level per phase; the DP refuses them."""
    prof = random_profile(8, 11, chain=False)
    bwd = [k for k, p in enumerate(prof.phases) if p.kind == "backward"]
    prof.phases[bwd[0]], prof.phases[bwd[1]] = prof.phases[bwd[1]], prof.phases[bwd[0]]
    from memfit.planning.intmodel import chain_layout

    assert chain_layout(IntModel.of(prof)) is None
    hi = memfit.predict(prof, {}).peak_bytes
    _, lo = brute_force(prof, hi, 1)
    assert min_budget_bytes(prof) == lo
    for budget in (lo, (lo + hi) // 2, hi):
        expected, _ = brute_force(prof, budget, 1)
        for solver in ("cpsat", "cbc"):
            assert memfit.plan(prof, budget, solver=solver).predicted_recompute_s == pytest.approx(expected)
    with pytest.raises(memfit.MemfitError, match="chain"):
        memfit.plan(prof, hi, solver="dp")


def test_time_limit_without_an_answer_falls_back_to_a_baseline():
    prof = random_profile(300, 1, scale=2**20)
    hi = memfit.predict(prof, {}).peak_bytes
    budget = memfit.predict(prof, dict.fromkeys(prof.unit_names, policy.FULL)).peak_bytes
    budget = max(budget, hi // 2)
    sched = memfit.plan(prof, budget, time_limit=0.001)
    assert sched.predicted_peak_bytes <= budget
    if sched.strategy != "ilp":  # the usual case: CP-SAT has not even presolved in 1 ms
        assert sched.solver_status.startswith("time limit: no cpsat answer")
        assert sched.baselines[sched.strategy]["fits"]


def fine_assignments(profile, max_segment):
    """Every assignment with each unit's finer options too (segments stay none/full composed)."""
    extra = [[Role(k) for k in u.options if k not in policy.COARSE] for u in profile.units]
    for roles in assignments(len(profile.units), max_segment):
        choices = [[r, *extra[j]] if r == FULL else [r] for j, r in enumerate(roles)]
        yield from itertools.product(*choices)


@pytest.mark.parametrize("seed", range(6))
def test_fine_options_optimum_equals_brute_force(seed):
    """With two finer options per unit, every solver hits the optimum of the memory model, and
    no plan of module granularity is cheaper; from seed 3 on, options free bytes after their unit."""
    prof = random_profile(4 + seed % 3, seed, fine=2, frees=seed >= 3)
    names = prof.unit_names
    hi = memfit.predict(prof, {}).peak_bytes
    best_peak = min(memfit.predict(prof, {n: r.policy(names) for n, r in zip(names, roles, strict=True)}).peak_bytes
                    for roles in fine_assignments(prof, 3))
    assert min_budget_bytes(prof, max_segment=3, fine=True) == best_peak
    rng = random.Random(seed)
    for budget in [best_peak, hi, *(rng.randint(best_peak, hi) for _ in range(3))]:
        expected = None
        for roles in fine_assignments(prof, 3):
            pred = memfit.predict(prof, {n: r.policy(names) for n, r in zip(names, roles, strict=True)})
            if pred.peak_bytes <= budget and (expected is None or pred.recompute_s < expected):
                expected = pred.recompute_s
        for solver in ("cpsat", "cbc", "dp"):
            sched = memfit.plan(prof, budget, solver=solver, max_segment=3, granularity="fine")
            assert sched.predicted_peak_bytes <= budget
            assert sched.predicted_recompute_s == pytest.approx(expected, abs=1e-12), solver
        coarse = brute_force(prof, budget, 3)[0]
        assert coarse is None or expected <= coarse + 1e-12


def _fine_solvers_hit_brute_force(prof, chain: bool, seed: int):
    """CP-SAT and CBC (and the DP, on chains) at five budgets from the floor to the unplanned peak,
    against the brute-force optimum over every fine assignment (segments only on chains); the
    floor too. Returns the assignments as policies and the floor."""
    names = prof.unit_names
    hi = memfit.predict(prof, {}).peak_bytes
    plans = [{n: r.policy(names) for n, r in zip(names, roles, strict=True)}
             for roles in fine_assignments(prof, 3 if chain else 1)]
    predicted = [memfit.predict(prof, p) for p in plans]
    best_peak = min(p.peak_bytes for p in predicted)
    assert min_budget_bytes(prof, max_segment=3, fine=True) == best_peak
    rng = random.Random(seed)
    for budget in [best_peak, hi, *(rng.randint(best_peak, hi) for _ in range(3))]:
        expected = min(p.recompute_s for p in predicted if p.peak_bytes <= budget)
        for solver in ("cpsat", "cbc", "dp") if chain else ("cpsat", "cbc"):
            sched = memfit.plan(prof, budget, solver=solver, max_segment=3, granularity="fine")
            assert sched.predicted_peak_bytes <= budget
            assert sched.predicted_recompute_s == pytest.approx(expected, abs=1e-12), (solver, budget)
    return plans, best_peak


@pytest.mark.parametrize("seed", range(6))
def test_options_that_hold_no_outside_tensors_optimum_equals_brute_force(seed):
    """A finer option that keeps no tensor made outside the units (``derive``, a child region that
    takes no mask: ``holds_outside`` False) leaves the remainders at the plain step's end and peak
    while no unit under another option keeps such tensors: CP-SAT, CBC and the DP (on chains) hit
    the brute-force optimum of that memory model, and the plan of each unit's first finer option
    peaks lower for it than if those options held them."""
    chain = seed % 2 == 0
    prof = random_profile(4 + seed % 3, seed, chain=chain, fine=2, frees=seed >= 3, holds=True)
    _fine_solvers_hit_brute_force(prof, chain, seed)
    names = prof.unit_names
    first = {n: next(k for k in u.options if k not in policy.COARSE) for n, u in zip(names, prof.units, strict=True)}
    free = memfit.predict(prof, first).peak_bytes
    for u in prof.units:
        for o in u.options.values():
            o.holds_outside = True
    assert memfit.predict(prof, first).peak_bytes > free


def test_fine_needs_a_fine_profile(gpt_profile):
    with pytest.raises(memfit.MemfitError, match="granularity='fine'"):
        memfit.plan(gpt_profile, "1GB", granularity="fine")


def _edges_and_sweep(prof):
    lo, peak = min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    return [lo - 1, lo, lo + 1, *(lo + (peak - lo) * k // 12 for k in range(1, 12)), peak - 1, peak, peak + 1]


@pytest.mark.parametrize("source", ["gpt-small", "cnn-mixed", "hf-gpt2", "hf-llama", "random-0", "random-1",
                                    "random-2"])
def test_every_solver_agrees_and_beats_every_baseline_at_every_budget(source):
    """At every budget of a sweep and at the edges (floor - 1, floor, floor + 1, peak - 1, peak,
    peak + 1): each solver fits or says infeasible exactly when the floor says so, the solvers'
    recompute times agree, and none is dearer than a baseline that fits (by predict, the exact
    model: the integer model rounds bytes up, so at the edges a baseline may be what fits)."""
    from pathlib import Path

    from memfit.planning.dp import dp_exact
    from memfit.planning.planner import TIE_FRACTION, baselines

    if source.startswith("random"):
        prof = random_profile(6, int(source[-1]), chain=True)
    else:
        prof = memfit.Profile.load(Path(__file__).parent / "fixtures" / f"{source}.json")
    solvers = ["cpsat", "cbc"] + (["dp"] if dp_exact(IntModel.of(prof)) else [])
    lo = min_budget_bytes(prof)
    step = prof.step_s
    for budget in _edges_and_sweep(prof):
        costs = {}
        for solver in solvers:
            if budget < lo:
                with pytest.raises(memfit.InfeasibleBudgetError):
                    memfit.plan(prof, budget, solver=solver)
                continue
            sched = memfit.plan(prof, budget, solver=solver)
            assert sched.predicted_peak_bytes <= budget
            costs[solver] = sched.predicted_recompute_s
        if budget < lo:
            continue
        assert max(costs.values()) - min(costs.values()) <= 1e-3 * step, (budget, costs)
        fitting = [f["recompute_s"] for f in baselines(prof, budget).values() if f.get("fits")]
        tie = TIE_FRACTION * step
        assert all(c <= min(fitting, default=float("inf")) + tie for c in costs.values()), (budget, costs, fitting)
        if budget >= memfit.predict(prof, {}).peak_bytes:
            assert all(c == 0 for c in costs.values())  # nothing to recompute where nothing needs to be


@pytest.mark.parametrize("seed", range(6))
def test_a_tail_that_lowers_the_heads_peak_optimum_equals_brute_force(seed):
    """The last unit's finer options lower the peak of the head and the loss after it (its
    ``derive`` re-derives the final norm's output: ``after_peak_bytes``): CP-SAT and CBC (and the
    DP, on chains) hit the brute-force optimum, and some budget needs the lowered peak."""
    chain = seed % 2 == 0
    prof = random_profile(4 + seed % 3, seed, chain=chain, fine=2, frees=seed >= 3, tail=True)
    assert all(o.after_peak_bytes <= 0 for o in prof.units[-1].options.values())
    assert any(o.after_peak_bytes < 0 for o in prof.units[-1].options.values())
    plans, best_peak = _fine_solvers_hit_brute_force(prof, chain, seed)
    for u in prof.units[-1].options.values():  # without the lowered peak the floor would be higher
        u.after_peak_bytes = 0
    floor = min(memfit.predict(prof, p).peak_bytes for p in plans)
    assert floor > best_peak if seed > 0 else floor == best_peak  # seed 0: the head's is not the floor's peak
