"""Baseline strategies: what each one picks, and that its prediction holds when measured."""

import copy

import pytest

import memfit
from memfit.planning.baselines import STRATEGIES
from memfit.planning.planner import strategy_min_budget
from memfit.policy import FULL, KEEP, Segment
from memfit.runtime.harness import measure_steps

from .conftest import random_profile, tiny_gpt


def test_strategies_follow_their_rules():
    prof = random_profile(9, 7)
    names = prof.unit_names
    full = memfit.predict(prof, dict.fromkeys(names, FULL)).peak_bytes
    none = memfit.predict(prof, {}).peak_bytes
    budget = (full + none) // 2
    assert STRATEGIES["none"](prof, budget) is None
    assert STRATEGIES["full"](prof, budget) == dict.fromkeys(names, FULL)
    first_k = STRATEGIES["first-k"](prof, budget)
    k = sum(p == FULL for p in first_k.values())
    assert list(first_k.values()) == [FULL] * k + [KEEP] * (len(names) - k)
    shorter = {n: FULL if j < k - 1 else KEEP for j, n in enumerate(names)}
    assert memfit.predict(prof, shorter).peak_bytes > budget  # k is the smallest that fits
    every = STRATEGIES["every-k"](prof, budget)
    step = next(j for j, n in enumerate(names) if every[n] == FULL) + 1
    assert all((every[n] == FULL) == ((j + 1) % step == 0) for j, n in enumerate(names))
    sqrt = STRATEGIES["sqrt"](prof, 10**12)
    assert all(isinstance(p, Segment) for p in sqrt.values())
    assert len(set(sqrt.values())) == 3  # nine units in three segments of three
    for name, strategy in STRATEGIES.items():
        found = strategy(prof, budget)
        if found is not None:
            assert memfit.predict(prof, found).peak_bytes <= budget, name


def test_ilp_never_worse_than_a_fitting_baseline():
    for seed in range(6):
        prof = random_profile(10, 50 + seed)
        lo = memfit.min_budget_bytes(prof)
        hi = memfit.predict(prof, {}).peak_bytes
        for frac in (0.1, 0.3, 0.6, 0.9):
            sched = memfit.plan(prof, int(lo + frac * (hi - lo)))
            for name, figures in sched.baselines.items():
                if figures["fits"]:
                    assert sched.predicted_recompute_s <= figures["recompute_s"] + 1e-12, name


def test_strategy_that_cannot_fit_says_its_minimum():
    prof = random_profile(8, 3)
    least = strategy_min_budget(prof, "first-k")
    assert memfit.plan(prof, least, strategy="first-k").predicted_peak_bytes <= least
    with pytest.raises(memfit.InfeasibleBudgetError, match="strategy first-k") as info:
        memfit.plan(prof, least - 1, strategy="first-k")
    assert info.value.min_budget_bytes == least


def test_baselines_predicted_equals_measured():
    model, inputs = tiny_gpt()
    prof = memfit.profile(model, inputs, repeat=1)
    budget = (memfit.min_budget_bytes(prof) + memfit.predict(prof, {}).peak_bytes) // 2
    seen = set()
    for name in STRATEGIES:
        try:
            sched = memfit.plan(prof, 2**40 if name == "none" else budget, strategy=name)
        except memfit.InfeasibleBudgetError:
            continue
        key = tuple(sched.policies.values())
        if key in seen:
            continue
        seen.add(key)
        twin = memfit.apply(copy.deepcopy(model), sched)
        measured = measure_steps(twin, inputs).peak_bytes
        assert measured <= sched.predicted_peak_bytes <= measured * 1.03, name
    assert len(seen) >= 4


def test_a_baseline_that_does_not_fit_shows_its_tightest_schedule():
    """Beside the plan, a baseline that cannot fit the budget still shows the least peak it
    reaches (its tightest schedule's figures, marked), not '-'; the report says what the marks
    and columns mean."""
    from memfit.planning.baselines import BASELINES
    from memfit.report import schedule_report

    prof = random_profile(9, 4)
    budget = memfit.min_budget_bytes(prof)
    sched = memfit.plan(prof, budget)
    missed = {k: v for k, v in sched.baselines.items() if not v["fits"]}
    assert missed, "at the smallest budget some baseline does not fit"
    for name, figures in missed.items():
        peaks = [memfit.predict(prof, c).peak_bytes for c in BASELINES[name].candidates(prof)]
        assert figures["peak_bytes"] == min(peaks) > budget
    text = schedule_report(sched, prof)
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    from memfit.report import BASELINE_NAMES

    for name in missed:
        row = next(v for k, v in rows.items() if k.startswith(BASELINE_NAMES[name]))
        assert memfit.format_bytes(missed[name]["peak_bytes"]) + " *" in row and " no " in row
    assert "*: the strategy does not fit; its tightest schedule's figures" in text


def test_the_unit_table_explains_kept_over_saved_and_segment_times():
    from memfit.formats.profile import Profile
    from memfit.report import schedule_report

    from .test_sweep import FIXTURES

    prof = Profile.load(FIXTURES / "hf-llama.json")
    sched = memfit.plan(prof, 100 * 2**20)
    text = schedule_report(sched, prof)
    assert any(isinstance(p, Segment) for p in sched.policies.values())
    assert "recompute: each member's own forward, once; a segment recomputes all its members together" in text
    assert "kept to bwd: what stays allocated" not in text  # kept never exceeds saved here
    gpt2 = Profile.load(FIXTURES / "hf-gpt2.json")
    unit = gpt2.units[0]
    unit.options[KEEP].stored_bytes = int(unit.saved_bytes * 1.05)
    assert "kept to bwd: what stays allocated" in schedule_report(memfit.plan(gpt2, 2**40), gpt2)
