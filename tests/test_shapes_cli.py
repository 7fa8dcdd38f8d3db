"""Several input shapes from the command line: profile, plan with a length histogram, show,
validate every shape, train with the example loop; and the mistakes, exit 2 with what to do."""

import json
import subprocess
import sys

import pytest

import memfit
from memfit.cli import main
from memfit.scenarios import load_scenario

from .conftest import TINY
from .test_cli import ROOT, run

LENS = TINY.replace("[args]", 'seq_lens = [8, 16, 32]\n[args]')  # the scenario field


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    (d / "tiny.toml").write_text(TINY)
    (d / "lens.toml").write_text(LENS)
    (d / "hist.csv").write_text("length,count\n5,60\n8,10\n12,20\n30,10\n")
    proc = run("profile", "--scenario", "tiny.toml", "--seq-lens", "16,8,32", "--repeat", "1", "-o", "p.json", cwd=d)
    assert proc.returncode == 0, proc.stderr
    assert "3 input shapes" in proc.stdout
    return d


def test_profile_plan_show_validate_and_train_at_three_lengths(workdir):
    data = json.loads((workdir / "p.json").read_text())
    assert data["format"] == "memfit.profiles/1"
    profiles = [memfit.formats.profile.profile_from_dict(p) for p in data["profiles"]]
    assert [p.source["seq_len"] for p in profiles] == [8, 16, 32]
    assert [p.input_shapes.split(", ")[0] for p in profiles] == ["idx=int64[2,8]", "idx=int64[2,16]", "idx=int64[2,32]"]
    plain = [memfit.predict(p, {}).peak_bytes for p in profiles]
    budget = max(plain[1], (memfit.min_budget_bytes(profiles[2]) + plain[2]) // 2)  # 32 does not fit unplanned
    proc = run("plan", "--profile", "p.json", "--budget", str(budget), "--seq-hist", "hist.csv", "-o", "s.json",
               cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("== shape")] == [
        "== shape 1 of 3: length 8 ==", "== shape 2 of 3: length 16 ==", "== shape 3 of 3: length 32 =="]
    schedule = memfit.load_schedule(workdir / "s.json")
    assert [p.share for p in schedule.plans] == [0.7, 0.2, 0.1]  # 5 and 8 count toward 8; 12 toward 16; 30 to 32
    assert not schedule.plans[0].checkpointed and schedule.plans[2].checkpointed
    expected = f"expected slowdown over the length histogram: {schedule.expected_overhead * 100:+.1f}%"
    assert expected in proc.stdout
    proc = run("show", "s.json", cwd=workdir)
    assert proc.returncode == 0 and expected in proc.stdout
    proc = run("validate", "--schedule", "s.json", "--scenario", "tiny.toml", "--steps", "1", "--json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["input_shapes"] for r in rows] == [p.input_shapes for p in schedule.plans]
    for row, plan in zip(rows, schedule.plans, strict=True):
        assert row["ok"] and row["grads_equal"] and row["measured_peak_bytes"] == plan.predicted_peak_bytes
    train = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--schedule", "s.json",
                            "--scenario", "tiny.toml", "--steps", "3"], cwd=workdir, capture_output=True,
                           text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    assert [line.split("(")[-1] for line in train.stdout.splitlines() if line.startswith("step")] == [
        "length 8)", "length 16)", "length 32)"]
    scheduled, batch = load_scenario(str(workdir / "tiny.toml")).build()
    memfit.apply(scheduled, schedule)
    longer = {k: v.repeat(1, 2) for k, v in batch.items()}  # 64 tokens: the warning says how to plan them too
    with pytest.warns(memfit.PlanDriftWarning, match="memfit plan --scenario .*tiny.toml --seq-lens 8,16,32,64 "):
        with pytest.raises(IndexError):  # which this model's 32 positions cannot run
            scheduled(**longer)


def test_sweep_draws_a_curve_per_length_over_one_range_of_budgets(workdir):
    import pandas as pd

    proc = run("sweep", "--profile", "p.json", "--points", "5", "--csv", "sw.csv", "--plot", "c.png", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("==")] == [
        "== length 8 ==", "== length 16 ==", "== length 32 =="]
    frame = pd.read_csv(workdir / "sw.csv")
    ilp = frame[frame["strategy"] == "ilp"]
    budgets = {name: list(rows["budget_bytes"]) for name, rows in ilp.groupby("shape")}
    assert set(budgets) == {"length 8", "length 16", "length 32"} and len({tuple(b) for b in budgets.values()}) == 1
    longest = ilp[ilp["shape"] == "length 32"].dropna(subset=["predicted_peak_bytes"])  # the tightest fits no 32
    assert longest["predicted_overhead"].iloc[0] > 0 == longest["predicted_overhead"].iloc[-1]  # tight to loose
    assert (workdir / "c.png").stat().st_size > 10_000


def test_a_scenario_with_seq_lens_is_planned_at_each_and_estimated_for_a_gpu(workdir):
    proc = run("plan", "--scenario", "lens.toml", "--target", "h100", "--budget", "80GB", "--json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [s["source"]["seq_len"] for s in data["shapes"]] == [8, 16, 32] and data["target"] == "h100"


@pytest.mark.parametrize(("args", "message"), [
    (["plan", "--scenario", "tiny.toml", "--seq-lens", "8,8", "--budget", "1GB"], "distinct positive integers"),
    (["plan", "--scenario", "tiny.toml", "--seq-lens", "0,8", "--budget", "1GB"], "distinct positive integers"),
    (["plan", "--profile", "p.json", "--budget", "1GB", "--seq-hist", "missing.csv"], "no such file"),
    (["plan", "--scenario", "tiny.toml", "--budget", "1GB", "--seq-hist", "hist.csv"], "give --seq-lens"),
    (["plan", "--profile", "p.json", "--budget", "1GB", "--compile", "aot_eager"], "plans one input shape"),
    (["plan", "--scenario", "tiny.toml", "--seq-lens", "8,16", "--input-shape", "2x8", "--input-shape", "2x16",
      "--budget", "1GB"], "not both"),
    (["validate", "--schedule", "s.json", "--timeline", "t.png"], "validated at each of them"),
])
def test_mistakes_with_shapes_exit_2(workdir, args, message, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    if args[0] == "validate" and not (workdir / "s.json").exists():
        pytest.skip("needs the schedule of the test above")
    assert main([*args, "--repeat", "1"] if args[0] == "plan" and "--profile" not in args else args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
