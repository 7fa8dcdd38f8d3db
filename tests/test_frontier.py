"""planning/frontier.py on its own: the whole memory/recompute frontier of a chain from one DP,
each point optimal at its peak (brute force), and each budget read off it as plan would answer."""

import itertools
import random

import pytest

import memfit
from memfit.planning.frontier import chain_frontier, read
from memfit.planning.intmodel import IntModel

from .conftest import random_profile
from .test_dp import MAX_SEGMENT, _all


@pytest.mark.parametrize("seed", range(5))
def test_every_point_is_optimal_and_every_budget_reads_off_it(seed):
    prof = random_profile(5 + seed % 3, seed)
    model = IntModel.of(prof, max_segment=MAX_SEGMENT)
    points = chain_frontier(model)
    assert [p.peak for p in points] == sorted({p.peak for p in points})  # rising peaks
    assert all(a.recompute_ns > b.recompute_ns for a, b in itertools.pairwise(points))  # falling recompute
    every = list(_all(prof))
    names = prof.unit_names
    for p in points:
        pred = memfit.predict(prof, {n: r.policy(names) for n, r in zip(names, p.roles, strict=True)})
        assert pred.peak_bytes == p.peak and round(pred.recompute_s * 1e9) == p.recompute_ns
        assert p.recompute_ns == min(round(q.recompute_s * 1e9) for _, q in every if q.peak_bytes <= p.peak)
    rng = random.Random(seed)
    hi = max(q.peak_bytes for _, q in every)
    caps = sorted({points[0].peak, hi, *(rng.randint(points[0].peak, hi) for _ in range(5))})
    rounded = chain_frontier(model, caps)  # levels rounded up to the caps: the same answers
    for cap in caps:
        best = min(round(q.recompute_s * 1e9) for _, q in every if q.peak_bytes <= cap)
        assert read(points, cap).recompute_ns == best
        assert read(rounded, cap).recompute_ns == best
    assert read(points, points[0].peak - 1) is None


def test_none_off_a_chain():
    prof = random_profile(4, 1, chain=False)
    prof.phases.reverse()
    assert chain_frontier(IntModel.of(prof)) is None


@pytest.mark.parametrize("seed", range(4))
def test_options_that_hold_no_outside_tensors_are_on_the_frontier(seed):
    """Finer options that keep no tensor made outside the units (``holds_outside`` False) leave the
    remainders at their plain figures: every frontier point is the brute-force optimum at its peak."""
    from .test_optimizer import fine_assignments

    prof = random_profile(4 + seed % 2, seed, fine=2, holds=True)
    points = chain_frontier(IntModel.of(prof, max_segment=3, fine=True))
    names = prof.unit_names
    every = [memfit.predict(prof, {n: r.policy(names) for n, r in zip(names, roles, strict=True)})
             for roles in fine_assignments(prof, 3)]
    assert points
    for p in points:
        pred = memfit.predict(prof, {n: r.policy(names) for n, r in zip(names, p.roles, strict=True)})
        assert pred.peak_bytes == p.peak  # recompute: the model's ns are rounded per unit
        assert abs(round(pred.recompute_s * 1e9) - p.recompute_ns) <= len(names)
        best = min(round(q.recompute_s * 1e9) for q in every if q.peak_bytes <= p.peak)
        assert abs(p.recompute_ns - best) <= len(names)
