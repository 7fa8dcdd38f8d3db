"""planning/dp.py, the exact chain DP, on its own: the optimum of the integer model at a budget
and the least peak, each equal to brute force over every assignment; refused off a chain."""

import random

import pytest

import memfit
from memfit.errors import MemfitError
from memfit.planning.dp import dp_exact, solve_dp
from memfit.planning.intmodel import IntModel
from memfit.policy import FULL

from .conftest import random_profile
from .test_optimizer import assignments

MAX_SEGMENT = 3


def _all(profile):
    names = profile.unit_names
    for roles in assignments(len(names), MAX_SEGMENT):
        yield roles, memfit.predict(profile, {n: r.policy(names) for n, r in zip(names, roles, strict=True)})


@pytest.mark.parametrize("seed", range(6))
def test_least_recompute_and_least_peak_equal_brute_force(seed):
    prof = random_profile(5 + seed % 3, seed)
    model = IntModel.of(prof, max_segment=MAX_SEGMENT)
    assert model.quantum == 1 and dp_exact(model)  # small integers: the scaled model is the real one
    every = list(_all(prof))
    least = min(p.peak_bytes for _, p in every)
    roles, status, objective = solve_dp(model, None, "peak")
    assert status == "optimal" and objective == least
    rng = random.Random(seed)
    for cap in [least, *(rng.randint(least, max(p.peak_bytes for _, p in every)) for _ in range(4))]:
        best = min(round(p.recompute_s * 1e9) for _, p in every if p.peak_bytes <= cap)
        roles, _, objective = solve_dp(model, cap, "recompute")
        names = prof.unit_names
        pred = memfit.predict(prof, {n: r.policy(names) for n, r in zip(names, roles, strict=True)})
        assert objective == best and pred.peak_bytes <= cap
    assert solve_dp(model, least - 1, "recompute") is None


def test_not_exact_when_a_role_changes_a_units_net():
    prof = random_profile(4, 0)
    assert dp_exact(IntModel.of(prof))
    prof.units[2].options[FULL].bwd_end_bytes += 1  # full now leaves a byte more than none
    assert not dp_exact(IntModel.of(prof))


def test_refused_off_a_chain():
    prof = random_profile(4, 1, chain=False)
    prof.phases.reverse()  # backwards before forwards: not a chain's timeline
    with pytest.raises(MemfitError, match=r"needs a chain.*--solver cpsat"):
        solve_dp(IntModel.of(prof), None, "peak")
