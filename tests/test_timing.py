"""Time figures that hold: validate judges the slowdown; option costs agree between profiles and
between identical units, within the uncertainty the profile records."""

import dataclasses
import json
import math
from typing import Any

import pytest
import torch

import memfit
from memfit import zoo
from memfit.cli import main
from memfit.formats.schedule import load_schedule
from memfit.measure.timing import ratio_uncertainties, ratio_uncertainty
from memfit.policy import FULL, KEEP, Derive, Option, Segment
from memfit.report import validation_report

from .conftest import TINY, tiny_gpt


def test_ratio_uncertainty_is_two_standard_errors_of_the_median_from_the_interquartile_range():
    plain = [1.0, 1.0, 1.0, 1.0, 1.0]
    other = [1.1, 1.2, 1.3, 1.4, 5.0]  # one spoiled round does not widen it
    assert ratio_uncertainty(plain, other) == pytest.approx(2 * 1.2533 * 0.2 / 1.349 / math.sqrt(5))
    assert math.isnan(ratio_uncertainty(plain[:2], other[:2]))  # two rounds say nothing of the noise


def test_an_option_whose_rounds_happened_to_agree_gets_the_series_pooled_uncertainty():
    plain = [1.0] * 5
    steady = [1.2] * 5  # the same ratio in every round: an interquartile range of 0, by chance
    noisy = [[1.1, 1.3, 1.2, 1.0, 1.4], [1.5, 1.2, 1.3, 1.6, 1.4]]
    got = ratio_uncertainties(plain, [steady, *noisy])
    pooled = 2 * 1.2533 * 0.1 / 1.349 / math.sqrt(5)  # the 15 ratios about their own medians: IQR 0.1
    assert ratio_uncertainty(plain, steady) == 0 and got[0] == pytest.approx(pooled)
    assert got[1:] == [ratio_uncertainty(plain, o) for o in noisy]  # wider than the floor: their own
    assert ratio_uncertainties(plain, [steady]) == [0.0]  # alone, its own
    assert all(math.isnan(u) for u in ratio_uncertainties(plain[:2], [steady[:2]]))


def test_validate_fails_when_the_measured_slowdown_is_off_the_predicted():
    model, inputs = tiny_gpt()
    prof = memfit.profile(model, inputs, repeat=1)
    sched = memfit.plan(prof, memfit.predict(prof, dict.fromkeys(prof.unit_names, FULL)).peak_bytes)
    # The plan claims 500 points more slowdown than checkpointing costs: an error no noise explains.
    wrong = dataclasses.replace(sched, predicted_overhead=sched.predicted_overhead + 5.0)
    bad = memfit.validate(model, inputs, wrong, steps=5)
    assert bad.time_judged and not bad.time_ok and not bad.ok
    assert bad.fits and bad.grads_equal  # only time failed
    assert 0 <= bad.overhead_uncertainty < 5.0
    assert "OFF the predicted" in validation_report(bad) and "uncertainty" in validation_report(bad)
    loose = memfit.validate(model, inputs, wrong, steps=3, time_tolerance=100.0)
    assert loose.time_ok and loose.ok
    once = memfit.validate(model, inputs, wrong, steps=1)  # one round tells no uncertainty: time not judged
    assert not once.time_judged and once.time_ok and "not judged" in validation_report(once)


def test_cli_validate_exits_1_on_a_slowdown_error_above_its_tolerance(tmp_path, capsys):
    (tmp_path / "tiny.toml").write_text(TINY)
    out = tmp_path / "s.json"
    assert main(["plan", "--scenario", str(tmp_path / "tiny.toml"), "--budget", "100GB", "--strategy", "full",
                 "--repeat", "1", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    data["predicted_overhead"] += 5.0  # injected: the plan's time is 500 points off
    out.write_text(json.dumps(data))
    assert load_schedule(out).predicted_overhead == data["predicted_overhead"]
    capsys.readouterr()
    assert main(["validate", "--schedule", str(out), "--steps", "5", "--trust-source"]) == 1
    text = capsys.readouterr().out
    assert "OFF the predicted" in text and "validation FAILED" in text
    assert main(["validate", "--schedule", str(out), "--steps", "5", "--trust-source", "--time-tolerance", "100000",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["time_judged"] and result["time_ok"] and result["ok"]
    assert main(["validate", "--schedule", str(out), "--time-tolerance", "-1"]) == 2


def six_blocks():
    return zoo.gpt(batch=2, seq=32, vocab=128, d_model=64, n_head=2, n_layer=6, dropout=0.0)


def test_identical_blocks_get_one_cost_per_option():
    model, inputs = six_blocks()
    prof = memfit.profile(model, inputs, repeat=3, granularity="fine")
    assert len({u.fwd_s for u in prof.units}) == 1 and len({u.bwd_s for u in prof.units}) == 1
    options = set(prof.units[0].options)
    assert len(options) > 3  # finer options were measured
    for o in options:
        # derive on the first and last blocks also takes the head and the tail (the embeddings' sum,
        # the final norm's output): they free more than the others, and are priced on their own
        # (derive on a child takes neither: one cost for all six)
        first, *middle, last = prof.units
        ends = isinstance(o, Derive) and not o.child
        alike = middle if ends else prof.units
        if ends:
            assert first.options[o].freed_after_bytes > middle[0].options[o].freed_after_bytes, o
            assert last.options[o].after_peak_bytes < 0, o
        assert len({u.options[o].recompute_s for u in alike}) == 1, o
        assert len({u.options[o].recompute_uncertainty_s for u in alike}) == 1, o
        assert o == KEEP or prof.units[0].options[o].recompute_uncertainty_s > 0, o


# A timing claim checked by timing, so in the slow set (the project's rule: timing claims belong in
# benchmarks/, not in the suite CI gates on): inside the full suite it failed 2 runs of about 7
# (2026-12-05 and -06), both times on one option, selective:gemm@attn, in both of its pairs, while it
# passed alone 4 of 4 and after a rank test 3 of 3; the cause (something in a long test process that
# slows SAC's Python dispatch modes in one profile and not the other) is not found.
@pytest.mark.slow
def test_two_profiles_agree_within_their_recorded_uncertainty():
    """As shares of each profile's own step, which is what a cost's uncertainty is of (a ratio to
    the plain step, measure/timing.ratio_uncertainties) and what a plan's slowdown is: a shared
    machine's speed drifts by 10% from one minute to the next, and with it every time in seconds
    (compared in seconds, the two profiles disagreed in 1 run of 4 on a busy 2-core machine).

    The promise is conditional: a profile whose identical units scattered warns that the machine
    was busy and its times are not to be relied on (CI met one whose forwards took 0.33 to 7.54 ms,
    and its ``selective:gemm`` cost three times the other profile's). Such a pair is measured again,
    once; a second busy pair skips, saying so, rather than judging noise the profile disowned."""
    import warnings

    from memfit.errors import NoisyTimesWarning

    model, inputs = zoo.gpt(batch=2, seq=32, vocab=128, d_model=64, n_head=2, n_layer=4, dropout=0.0)

    def pair() -> tuple[memfit.Profile, memfit.Profile] | None:
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", NoisyTimesWarning)
                a, b = (memfit.profile(model, inputs, repeat=7, granularity="fine") for _ in range(2))
            if not any(issubclass(w.category, NoisyTimesWarning) for w in caught):
                return a, b
        return None

    def outside(a: memfit.Profile, b: memfit.Profile) -> tuple[list[Option], int]:
        """The options whose two costs differ by more than their uncertainties, and how many were compared."""
        out, compared = [], 0
        for ua, ub in zip(a.units, b.units, strict=True):
            for o in set(ua.options) & set(ub.options):
                ca, cb = ua.options[o], ub.options[o]
                differ = abs(ca.recompute_s / a.step_s - cb.recompute_s / b.step_s)
                if differ > ca.recompute_uncertainty_s / a.step_s + cb.recompute_uncertainty_s / b.step_s:
                    out.append(o)
                compared += o != KEEP
        return out, compared

    # Each of a dozen options is within two standard errors about 95% of the time: one of them
    # can fall outside by chance (CI met one at 0.115 against 0.102 of the step, the two plain
    # steps 19% apart). A second pair, measured anew, must then agree on every option: an
    # uncertainty recorded too small fails both.
    for attempt in range(2):
        made = pair()
        if made is None:
            pytest.skip("both pairs of profiles warned that the machine was busy (NoisyTimesWarning)")
        failing, compared = outside(*made)
        assert compared >= 4 * len(made[0].units)  # finer options were compared, not only none and full
        if not failing:
            break
        assert attempt == 0, failing


def test_scattered_times_of_identical_units_are_warned_of_and_a_steady_outlier_is_not():
    import warnings

    from memfit.errors import NoisyTimesWarning
    from memfit.profiler.costs import check_alike

    names = [f"h.{j}" for j in range(4)]
    steady = [[0.8, 0.8, 0.8], [0.3, 0.31, 0.3], [0.3, 0.3, 0.29], [0.3, 0.3, 0.31]]  # the first unit's stretch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_alike(steady, [0, 0, 0, 0], names)
        check_alike([[0.3, 9.0, 0.3]] * 4, [0, 1, 2, 3], names)  # units unlike each other: nothing to compare
    busy = [[0.3, 0.9, 0.3], [0.8, 0.3, 0.3], [0.3, 0.3, 1.1], [0.7, 0.3, 0.9]]
    with pytest.warns(NoisyTimesWarning, match="the machine was busy"):
        check_alike(busy, [0, 0, 0, 0], names)


def test_a_fine_gain_within_the_costs_uncertainty_is_said_and_still_taken():
    """Where the module-level plan's costs are unsure (a busy machine), a fine plan cheaper by less
    than that noise is still taken, and the report says the two cost the same within it."""
    from memfit.report import schedule_report

    prof, _, differs = _fine_plans_that_win()
    sure = {b: memfit.plan(prof, b, granularity="fine").policies for b in differs}
    _unsure(prof, lambda name: 1.0 if name == FULL else 0.0)
    for b in differs:  # the same plans, the lower prediction being the better bet; the doubt is said
        sched = memfit.plan(prof, b, granularity="fine")  # identical blocks: any of the equal plans
        assert sched.policies != memfit.plan(prof, b).policies
        assert sched.predicted_recompute_s == pytest.approx(memfit.predict(prof, sure[b]).recompute_s)
        assert "within the costs' noise" in sched.solver_status
        assert "cost the same within the measurement's noise" in schedule_report(sched)
    nothing = memfit.plan(prof, memfit.predict(prof, {}).peak_bytes)  # nothing to gain
    assert "within the measurement's noise" not in schedule_report(nothing)


def test_an_option_cheaper_by_less_than_its_noise_is_not_taken():
    """The planner weighs a cost as its estimate plus one standard error (planning/roles.weighed):
    the cheapest-looking of many noisy estimates tends to be one that came out low. Fine options
    priced at a thousandth of ``full`` win where they are sure; known only to an uncertainty of
    ten times ``full``'s cost, they are not taken: the fine solve itself lands on the module-level
    plan. The plan's predicted recompute is the estimate itself."""
    prof, _, differs = _fine_plans_that_win()
    full_s = max(u.options[FULL].recompute_s for u in prof.units)
    _unsure(prof, lambda name: 0.0 if name == FULL else 10 * full_s)
    for b in differs:
        sched = memfit.plan(prof, b, granularity="fine")
        assert all(p in (KEEP, FULL) or isinstance(p, Segment) for p in sched.policies.values())
        assert sched.predicted_recompute_s == pytest.approx(memfit.plan(prof, b).predicted_recompute_s)


def _fine_plans_that_win() -> tuple[Any, list[int], list[int]]:
    """A fine profile of a tiny GPT whose finer options are priced near free and sure, and the
    budgets (of four across its range) where the fine plan differs from the module-level one."""
    model, inputs = tiny_gpt()
    prof = memfit.profile(model, inputs, repeat=3, granularity="fine")
    lo, hi = memfit.min_budget_bytes(prof, fine=True), memfit.predict(prof, {}).peak_bytes
    budgets = [int(lo + f * (hi - lo)) for f in (0.2, 0.4, 0.6, 0.8)]
    assert memfit.plan(prof, budgets[1], granularity="fine").predicted_uncertainty_s > 0
    _unsure(prof, lambda name: 0.0)
    for u in prof.units:  # fine options priced near free (measured, they may tie with the module plan: CI stop 32)
        for name, o in u.options.items():
            if name not in (KEEP, FULL):
                o.recompute_s = 1e-3 * u.options[FULL].recompute_s
    differs = [b for b in budgets if memfit.plan(prof, b, granularity="fine").policies != memfit.plan(prof, b).policies]
    assert differs  # somewhere the fine options win, when the costs are taken as sure
    return prof, budgets, differs


def _unsure(prof: Any, seconds: Any) -> None:
    """Every option's uncertainty but none's set by its name, as a quiet or a very busy machine."""
    for u in prof.units:
        for name, o in u.options.items():
            o.recompute_uncertainty_s = 0.0 if name == KEEP else seconds(name)


def test_cuda_marks_are_timed_by_events_read_once_after_the_step(monkeypatch):
    """On CUDA a synchronisation at every mark would serialise host and device (launch-bound steps
    then measured 2 to 4 times their prediction, docs/cuda.md): the recorder records an event per
    mark and synchronises once, when its marks are read. A stand-in for the CUDA calls."""
    from memfit.measure.meters import TimeRecorder

    device_ms = [0.0]  # where the device's timeline is when an event is recorded
    syncs: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self, stream: object) -> None:
            assert stream == "stream"
            self.at = device_ms[0]

        def elapsed_time(self, other: "Event") -> float:
            assert syncs, "read before the device was synchronised"
            return other.at - self.at

    monkeypatch.setattr("torch.cuda.Event", Event)
    monkeypatch.setattr("torch.cuda.current_stream", lambda device: "stream")
    monkeypatch.setattr("torch.cuda.synchronize", lambda device: syncs.append("sync"))
    recorder = TimeRecorder(torch.device("cuda"))
    with recorder:
        for label, ms in [("forward", 5.0), ("fwd:0", 7.5), ("bwd:0", 12.0), ("done", 12.5)]:
            device_ms[0] = ms
            recorder.on_mark(label)
    assert syncs == []  # none while the step ran
    marks = recorder.marks()
    assert syncs == ["sync"]
    assert [(m.label, m.time_s) for m in marks] == [("forward", 0.0), ("fwd:0", 0.0025), ("bwd:0", 0.007),
                                                    ("done", 0.0075)]
    assert recorder.marks() == marks and syncs == ["sync"]  # read once


def test_an_options_own_work_is_timed_in_the_stretches_of_the_unit_that_does_it():
    """The profiler prices an option from the time of its own work (measure/host.Work, read at
    every mark by a CPU clock): a region's forward run again, in the backward of its unit; derive's
    hooks in its unit's forward and backward and its re-derived tensors' ops in the backward. A
    plain step counts none, ``full`` none in a forward, and nothing is counted while no clock
    reads it."""
    from memfit.measure import host
    from memfit.measure.inputs import Inputs
    from memfit.measure.step import default_loss, training_step
    from memfit.runtime.harness import StepHarness
    from memfit.runtime.marks import stretches
    from memfit.trainstep import step_of
    from memfit.units import find_units

    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    harness = StepHarness(model, Inputs.of(batch), loss_fn=default_loss, step=step_of(None, "adamw"))
    with harness.restoring(weights=True):
        state = harness.new_state()
        counted: dict[str, list] = {}
        for option in (KEEP, FULL, Derive()):
            with harness.options({n: option for n in names}):
                training_step(model, harness.inputs, default_loss, state)  # derive learns its plan here
                counted[str(option)] = stretches(harness.marked_step(state, names, "time"))
        assert host.work_seconds() == 0.0  # no clock counts now: the runtime's sections cost a read
        training_step(model, harness.inputs, default_loss, state)
        assert host.work_seconds() == 0.0
    assert all(s.work_s == 0.0 for s in counted["none"])
    full, derive = counted["full"], counted["derive"]
    assert all(s.work_s == 0.0 for s in full if not s.label.startswith("bwd:"))
    for i in range(len(names)):  # each unit's own, inside its stretches, and less than them
        for run, where in ((full, f"bwd:{i}"), (derive, f"fwd:{i}"), (derive, f"bwd:{i}")):
            own = next(s for s in run if s.label == where)
            assert 0.0 < own.work_s < own.seconds, (where, own)
    # derive's last unit also re-derives the tail (the final norm's output) where the backward starts
    assert next(s for s in derive if s.label == "backward").work_s > 0
    # recomputing a block's whole forward takes longer than re-deriving its norms' and GELU's outputs
    assert sum(s.work_s for s in full) > sum(s.work_s for s in derive if s.label.startswith("bwd:"))


def test_overheads_are_drawn_to_the_own_work_time_where_the_step_is_unsure():
    """costs.blended: overheads that agree with k x their own work's time (plus h a unit) within
    their noise are priced on that fit (weighted least squares), with the fit's smaller uncertainty; an option
    off the fit far beyond its noise, while the others agree, keeps most of its measurement; too
    few rounds, or nothing recomputed anywhere, leave the overheads as measured."""
    from memfit.profiler.costs import Overhead, blended

    # noise of +-10 (two standard errors) around 1.1 x the recompute time
    found = [Overhead(1.1 * d + e, 10.0, d) for d, e in [(100, 3), (20, -4), (50, 2), (5, 1), (70, -2)]]
    slope = sum(o.seconds * o.work_s for o in found) / sum(o.work_s ** 2 for o in found)
    priced = blended(found)
    assert [p.seconds for p in priced] == pytest.approx([slope * o.work_s for o in found])
    assert slope == pytest.approx(1.1, abs=0.02)
    assert all(0 < p.uncertainty_s < 10.0 for p in priced)
    assert priced[1].uncertainty_s < priced[0].uncertainty_s  # the fit's uncertainty scales with the time

    # one option costs 40 more than its work's time (a dispatch mode's every op, say): not priced away
    odd = [*found[:3], Overhead(1.1 * 30 + 40, 10.0, 30), *found[3:]]
    kept = blended(odd)[3]
    assert kept.seconds > 1.1 * 30 + 25 and kept.uncertainty_s <= 10.0 * 1.01

    # every option also costs 2 a unit beside its work (module hooks, say), options on 6 or 3 units
    each = [Overhead(1.1 * o.work_s + 2 * n + e, 10.0, o.work_s, n)
            for o, n, e in zip(found, (6, 6, 3, 6, 3), (1, -1, 0.5, -0.5, 0), strict=True)]
    fitted = blended(each)
    assert {(round(p.slope, 1), round(p.per_unit_s)) for p in fitted} == {(1.1, 2)}
    assert [p.seconds for p in fitted] == pytest.approx([1.1 * o.work_s + 2 * o.units for o in each], abs=1.5)

    assert blended([Overhead(o.seconds, math.nan, o.work_s) for o in found]) == \
        [Overhead(o.seconds, math.nan, o.work_s) for o in found]  # too few rounds to tell
    assert blended([Overhead(o.seconds, 10.0, 0.0) for o in found]) == \
        [Overhead(o.seconds, 10.0, 0.0) for o in found]  # estimate mode's clock: no work timed


def test_a_fine_profile_prices_its_options_from_their_own_work(monkeypatch):
    """profile() hands every option but the op sets to costs.blended, ``full`` first, each with the
    time of its steps' own work; ``full``'s factor is made from the blended overhead."""
    from memfit.policy import Selective
    from memfit.profiler import costs

    seen: list[list] = []
    out: list[list] = []

    def spy(found):
        seen.append(list(found))
        out.append(costs.blended.__wrapped__(found))
        return out[-1]

    spy.__wrapped__ = costs.blended
    monkeypatch.setattr(costs, "blended", spy)
    factors: list[tuple] = []
    factor = costs.recompute_factor
    monkeypatch.setattr(costs, "recompute_factor", lambda plain, full: factors.append((full, factor(plain, full)))
                        or factors[-1][1])
    model, inputs = tiny_gpt()
    prof = memfit.profile(model, inputs, repeat=3, granularity="fine")
    assert len(seen) == 1
    finer = [o for o in dict.fromkeys(o for u in prof.units for o in u.options) if o not in (KEEP, FULL)]
    recomputing = [o for o in finer if not isinstance(o, Selective)]
    assert len(seen[0]) >= 1 + len(recomputing) and len(recomputing) >= 3
    assert all(o.work_s > 0 for o in seen[0])  # every option did work of its own, full included
    (full, (made, sure)), = factors
    assert full is out[0][0] and made == prof.recompute_factor
    assert sure == pytest.approx(prof.units[0].options[FULL].recompute_uncertainty_s / prof.units[0].fwd_s)
