"""sweep(): the ILP at every budget equals plan(), the frontier never rises with the budget and
never loses to a baseline; the CSV, the curve and the timeline hold what was computed."""

import io
import itertools
import json
from pathlib import Path

import pandas as pd
import pytest

import memfit
from memfit.planning.frontier import chain_frontier, read
from memfit.planning.ilp import solve
from memfit.planning.intmodel import IntModel
from memfit.planning.sweep import COLUMNS, sweep
from memfit.plots import curve, timeline
from memfit.policy import KEEP, parse

from .conftest import random_profile, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
BUILTIN = sorted(FIXTURES.glob("*.json"))  # profiles of the built-in scenarios, made by `memfit profile`


@pytest.mark.parametrize(("n", "seed"), [(6, 1), (8, 2), (9, 5)])
def test_frontier_equals_the_ilp_at_every_budget(n, seed):
    prof = random_profile(n, seed)
    model = IntModel.of(prof)
    points = chain_frontier(model)
    assert points is not None
    lo = memfit.min_budget_bytes(prof)
    hi = memfit.predict(prof, {}).peak_bytes
    for budget in range(lo - 3, hi + 3, max(1, (hi - lo) // 120)):
        sol = solve(model, budget, solver="cbc")
        point = read(points, budget // model.quantum)
        assert (sol is None) == (point is None), budget
        if sol is not None:
            assert point is not None and point.recompute_ns == sol.objective, budget


@pytest.mark.parametrize("chain", [True, False])
def test_sweep_ilp_rows_equal_plan(chain):
    prof = random_profile(10, 4, chain=chain)
    frame = sweep(prof, points=15)
    ilp = frame[frame["strategy"] == "ilp"]
    assert len(ilp) == 15 and set(ilp["status"]) == {"optimal"}
    for row in ilp.itertuples():
        sched = memfit.plan(prof, int(row.budget_bytes))
        assert row.recompute_s == pytest.approx(sched.predicted_recompute_s, abs=1e-12)
        assert memfit.predict(prof, json.loads(row.policies)).peak_bytes == row.predicted_peak_bytes
        assert row.predicted_peak_bytes <= row.budget_bytes
    below = sweep(prof, [memfit.min_budget_bytes(prof) - 1], strategies=["ilp", "full"])
    assert list(below["status"]) == ["infeasible", "infeasible"] and below["predicted_peak_bytes"].isna().all()


def test_columns_dtypes_and_csv_round_trip(tmp_path):
    frame = sweep(random_profile(7, 2, chain=False), points=8)
    assert list(frame.columns) == list(COLUMNS)
    assert {c: str(t) for c, t in frame.dtypes.items()} == COLUMNS
    assert set(frame["strategy"]) == {"ilp", "full", "every-k", "sqrt", "first-k", "greedy"}
    assert set(frame.loc[frame["strategy"] == "sqrt", "status"]) == {"n/a"}  # not a chain
    frame.to_csv(tmp_path / "s.csv", index=False)
    again = pd.read_csv(tmp_path / "s.csv", dtype=COLUMNS, keep_default_na=False, na_values={
        "predicted_peak_bytes": [""], "checkpointed": [""], "predicted_overhead": [""], "recompute_s": [""],
        "predicted_uncertainty": [""]})
    again["policies"] = again["policies"].astype("string")
    pd.testing.assert_frame_equal(again, frame, check_exact=False, rtol=1e-12)


@pytest.mark.parametrize("path", BUILTIN, ids=[p.stem for p in BUILTIN])
def test_builtin_frontier_falls_and_beats_every_baseline(path):
    prof = memfit.Profile.load(path)
    frame = sweep(prof, points=30)
    ilp = frame[frame["strategy"] == "ilp"].sort_values("budget_bytes")
    assert not ilp["frontier_violation"].any()
    costs = list(ilp["recompute_s"])
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(costs))  # never dearer with more memory
    assert ilp["predicted_peak_bytes"].notna().all()  # the default budgets start at the smallest feasible peak
    for row in frame[(frame["strategy"] != "ilp") & frame["predicted_peak_bytes"].notna()].itertuples():
        mine = ilp.loc[ilp["budget_bytes"] == row.budget_bytes, "recompute_s"].item()
        assert mine <= row.recompute_s + 1e-12, (row.strategy, row.budget_bytes)


def test_curve_draws_the_frontier_and_baselines(tmp_path):
    prof = random_profile(8, 3)
    frame = sweep(prof, points=12)
    frame["measured_peak_bytes"] = frame["predicted_peak_bytes"]
    frame["measured_overhead"] = frame["predicted_overhead"] * 1.1
    for suffix in ("png", "svg"):
        fig = curve(frame, tmp_path / f"c.{suffix}", title="test model", device_memory=2048)
        assert (tmp_path / f"c.{suffix}").stat().st_size > 1000
    head = (tmp_path / "c.png").read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    ilp = frame[frame["strategy"] == "ilp"].drop_duplicates("policies").sort_values("predicted_peak_bytes")
    step = lines["memfit plan (ILP optimum)"]
    assert list(step.get_xdata()) == pytest.approx([v / 2**20 for v in ilp["predicted_peak_bytes"]])
    assert list(step.get_ydata()) == pytest.approx([v * 100 for v in ilp["predicted_overhead"]])
    measured = lines["memfit plan (ILP optimum), measured"]
    assert list(measured.get_ydata()) == pytest.approx([v * 110 for v in ilp["predicted_overhead"]])
    assert "checkpoint every unit" in lines and "no checkpointing" in lines
    assert ax.get_xlabel() == "peak memory of the training step (MiB)" and "%" in ax.get_ylabel()
    assert ax.get_title() == "test model" and fig.get_size_inches()[0] * fig.dpi == 800


def test_timeline_draws_predicted_levels(tmp_path):
    prof = random_profile(6, 1)
    sched = memfit.plan(prof, memfit.min_budget_bytes(prof) + 10)
    assert sched.levels["plan"] == [list(e) for e in memfit.predict(prof, sched.policies).levels]
    assert sched.levels["none"] == [list(e) for e in memfit.predict(prof, {}).levels]
    fig = timeline(sched.levels, tmp_path / "t.png", title="t", budget=sched.budget_bytes)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    for label, key in (("this plan", "plan"), ("no checkpointing", "none")):
        drawn = [v * 2**20 for v in lines[label].get_ydata()]
        assert drawn == pytest.approx([v for _, start, peak in sched.levels[key] for v in (start, peak)])
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_timeline_marks_checkpointed_units_and_keeps_its_words_readable():
    """The checkpointed units' phases are shaded (and only theirs), the peak label sits on a
    white box above the budget line, tick labels are 8 pt, and a long title is wrapped."""
    prof = random_profile(6, 1)
    sched = memfit.plan(prof, memfit.min_budget_bytes(prof) + 10)
    title = "m: plan\ninputs " + ", ".join(f"x{i}=float32[4,128]" for i in range(12))
    fig = timeline(sched.levels, None, title=title, budget=sched.budget_bytes, checkpointed=sched.checkpointed)
    ax = fig.axes[0]
    names = [n for n, _, _ in sched.levels["plan"]]
    shaded = sorted(round(p.get_x() + 0.5) for p in ax.patches)
    expected = [k for k, n in enumerate(names) if n.split(" ", 1)[-1] in sched.checkpointed]
    assert sched.checkpointed and shaded == expected and len(expected) == 2 * len(sched.checkpointed)
    label = next(t for t in ax.texts if t.get_text().startswith("peak "))
    budget_line = next(line for line in ax.get_lines() if line.get_label().startswith("budget"))
    assert label.get_bbox_patch().get_facecolor()[:3] == (1.0, 1.0, 1.0)
    assert label.get_zorder() > budget_line.get_zorder()
    assert {t.get_fontsize() for t in ax.get_xticklabels()} == {8}
    assert all(len(line) <= 90 for line in ax.get_title().splitlines())
    assert ax.get_title().replace("\n", " ").split() == title.replace("\n", " ").split()


def test_measured_timeline_equals_the_predicted_one():
    """On the CPU the live bytes at every mark of the scheduled step are the predicted ones.

    Per-unit plans (the next test fixes a segment layout): which plan the solver picks depends on
    measured times, and a segment's backward peaks are drawn a few bytes high, so a plan the
    solver chose with segments would make this test depend on the machine's load."""
    from memfit.steps.validate import measure_levels

    from .conftest import tiny_gpt

    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1)
    lo, hi = memfit.min_budget_bytes(prof, segments=False), memfit.predict(prof, {}).peak_bytes
    for budget in (lo, (lo + hi) // 2):
        sched = memfit.plan(prof, budget, segments=False)
        measured = measure_levels(model, batch, sched)
        assert [e[1:] for e in measured] == [e[1:] for e in sched.levels["plan"]]


def test_segment_timeline_forward_exact_backward_within_a_vector():
    """Inside a segment the forward marks are the predicted ones to the byte: a later member
    stashes no RNG state, and its input is freed only after it returns. In the backward the
    members before the last peak one vector of d_model floats below the kept unit's measured
    peak (measured: 256 B at d_model 64, 384 B at 96), which the prediction keeps: safe side."""
    from memfit.planning.peak import predict
    from memfit.steps.validate import measure_levels

    from .conftest import tiny_gpt

    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1)
    policies = dict.fromkeys(["h.0", "h.1", "h.2"], parse("segment:h.0..h.2")) | {"h.3": KEEP}
    sched = memfit.plan(prof, predict(prof, policies).peak_bytes, segments=True, max_segment=3)
    sched.policies, sched.levels = policies, {"plan": predict(prof, policies).levels}
    measured = measure_levels(model, batch, sched)
    predicted = sched.levels["plan"]
    assert [m[1] for m in measured] == [p[1] for p in predicted]  # every mark's level
    for m, p in zip(measured, predicted, strict=True):
        if p[0].startswith("backward"):
            assert 0 <= p[2] - m[2] <= 4 * 64, (p, m)
        else:
            assert m[2] == p[2], (p, m)
    assert max(m[2] for m in measured) == predict(prof, policies).peak_bytes


run = run_cli  # memfit's command line, in this process


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budgets", "500MB:100MB:10MB"], "the start is above the stop"),
        (["--budgets", "100MB:500MB"], "--budgets is START:STOP:STEP"),
        (["--budgets", "1MB:1GB:1KB"], "at most 1000"),
        (["--budgets", "100MB:500MB:0"], "positive"),
        (["--budgets", "lots"], "cannot read the memory size"),
        (["--budgets", "100MB,200MB", "--points", "5"], "either --budgets or --points"),
        (["--strategies", "ilp,magic"], "--strategies: unknown magic"),
        (["--plot", "c.pdf"], "as .png or .svg"),
        (["--csv", "."], "is a directory"),
        (["--units", "h.*"], "cannot change a profile"),
    ],
)
def test_sweep_mistakes_exit_2_without_files(tmp_path, args, message):
    random_profile(5, 0).save(tmp_path / "p.json")
    proc = run("sweep", "--profile", "p.json", "--csv", "out.csv", "--plot", "out.png", *args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_sweep_command_measures_and_writes(tmp_path):
    (tmp_path / "tiny.toml").write_text(
        'model = "memfit.zoo:gpt"\n[args]\nbatch = 2\nseq = 32\nvocab = 256\nd_model = 64\nn_head = 2\nn_layer = 3\n')
    proc = run("sweep", "--scenario", "tiny.toml", "--repeat", "3", "--points", "4", "--measure", "--steps", "3",
               "--strategies", "ilp,full", "--csv", "s.csv", "--plot", "s.svg", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan peak" in proc.stdout and "full slowdown" in proc.stdout and "measured peak" in proc.stdout
    frame = pd.read_csv(io.StringIO((tmp_path / "s.csv").read_text()))
    assert len(frame) == 8 and frame["measured_peak_bytes"].notna().all()
    # On the CPU the measured peak of every plan is the predicted one, to the byte.
    assert (frame["measured_peak_bytes"] == frame["predicted_peak_bytes"]).all()
    # Every slowdown comes with its uncertainty: the profile's for the predicted one (none where
    # nothing is recomputed), the timed rounds' for the measured one; the table prints both.
    ilp = frame[frame["strategy"] == "ilp"]
    assert ((ilp["predicted_uncertainty"] > 0) == (ilp["recompute_s"] > 0)).all()
    assert (frame["measured_uncertainty"] > 0).all() and " ±" in proc.stdout
    assert (tmp_path / "s.svg").read_text().lstrip().startswith("<?xml")


def test_a_pictures_title_names_the_steps_precision_and_the_target_estimated_for():
    """Issue 39 item 4: an amp-bf16 plan estimated for an RTX 4090 was titled "float32 - cuda"."""
    from types import SimpleNamespace

    from memfit.cli.flags import title as _title

    made = SimpleNamespace(source={"scenario": "gpt-750m", "dtype": "float32"}, fingerprint={},
                           step={"precision": "amp-bf16"}, target="rtx4090", device="cuda",
                           input_shapes="idx=int64[8,1024]", optimizer="adamw")
    title = _title(made, "memory vs slowdown")
    assert title == ("gpt-750m: memory vs slowdown\ninputs idx=int64[8,1024] - amp-bf16 - estimated for rtx4090, "
                     "optimizer adamw")
    measured = SimpleNamespace(**{**vars(made), "step": {}, "target": "", "device": "cpu"})
    assert "float32 - cpu" in _title(measured, "plan")


def test_timeline_ticks_are_short_and_the_legend_leaves_the_curves_alone():
    """Whisper's units (``model.encoder.layers.N``, ``model.decoder.layers.N``) made tick labels
    such as "forward after model.decoder.layers.10" that took half the figure, and the legend sat
    on the curves' start: ticks now drop the shared prefix and the phase words' length, and the
    legend sits right of the axes."""
    names = [f"model.{part}.layers.{i}" for part in ("encoder", "decoder") for i in range(12)]
    phases = ["forward before the units"]
    for n in names:
        phases += [f"forward {n}", f"forward after {n}" + (" (head, loss)" if n == names[-1] else "")]
    phases += ["backward of loss and head"]
    for n in reversed(names):
        phases += [f"backward {n}", f"backward before {n}"]
    phases += ["optimizer step"]
    levels = {"plan": [[p, 100 + k, 120 + k] for k, p in enumerate(phases)],
              "none": [[p, 100 + 2 * k, 130 + 2 * k] for k, p in enumerate(phases)]}
    fig = timeline(levels, None, title="whisper", budget=200, checkpointed=names[::2])
    ax = fig.axes[0]
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks and max(map(len, ticks)) <= 30 and not any(t.startswith(("forward", "backward")) for t in ticks)
    assert any("encoder.layers" in t and "model." not in t for t in ticks)
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1  # beside the axes, on no curve
    tick_height = max(t.get_window_extent().height for t in ax.get_xticklabels())
    assert tick_height < 0.25 * fig.bbox.height
