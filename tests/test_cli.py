"""The command line as a user meets it: exit codes, messages, files written or not written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

from .conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "tiny.toml").write_text(TINY)
    proc = run("profile", "--scenario", "tiny.toml", "--repeat", "1", "-o", "profile.json", cwd=d)
    assert proc.returncode == 0, proc.stderr
    assert "h.3" in proc.stdout and "wrote profile.json" in proc.stdout
    assert "units: h.0-3 (4) (the repeated blocks; --units names others)" in proc.stderr  # what auto took
    return d


def test_plan_table_json_and_file(workdir):
    prof = memfit.Profile.load(workdir / "profile.json")
    budget = (memfit.min_budget_bytes(prof) + memfit.predict(prof, {}).peak_bytes) // 2
    proc = run("plan", "--profile", "profile.json", "--budget", str(budget), "-o", "s.json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    for text in ("policy", "checkpoint nothing", "checkpoint every unit", "memfit plan (ilp)", "memfit.apply"):
        assert text in proc.stdout
    sched = memfit.load_schedule(workdir / "s.json")
    assert sched.predicted_peak_bytes <= budget and sched.checkpointed
    proc = run("plan", "--profile", "profile.json", "--budget", str(budget), "--solver", "cbc", "--json",
               "-o", "s2.json", cwd=workdir)
    data = json.loads(proc.stdout)
    # identical blocks cost the same (profiler/costs.py): the solvers may pick different plans of one cost
    assert data["format"] == "memfit.schedule/1" and data["predicted_peak_bytes"] <= budget
    assert data["predicted_recompute_s"] == pytest.approx(sched.predicted_recompute_s, rel=1e-3)
    proc = run("show", "s.json", cwd=workdir)
    assert proc.returncode == 0 and "h.0" in proc.stdout
    proc = run("show", "profile.json", cwd=workdir)
    assert proc.returncode == 0 and "kept (full)" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--profile", "profile.json", "--budget", "lots"], "cannot read the memory size"),
        (["plan", "--profile", "profile.json", "--budget", "1MB"], "smallest budget that works"),
        (["plan", "--profile", "missing.json", "--budget", "1GB"], "no such file"),
        (["plan", "--profile", "tiny.toml", "--budget", "1GB"], "not valid JSON"),
        (["plan", "--scenario", "nope", "--budget", "1GB"], "no scenario named 'nope'"),
        (["plan", "--model", "no_such_module:f", "--budget", "1GB"], "cannot import"),
        (["show", "missing.json"], "no such file"),
        (["validate", "--schedule", "missing.json"], "no such file"),
        (["validate", "--schedule", "missing.json", "--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_user_mistakes_exit_2_without_output(workdir, args, message):
    proc = run(*args, "-o", "never.json", cwd=workdir) if args[0] == "plan" else run(*args, cwd=workdir)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.startswith("memfit: error:") or "building" in proc.stderr
    assert not (workdir / "never.json").exists()


def test_validate_and_example(workdir):
    proc = run("plan", "--scenario", "tiny.toml", "--repeat", "1", "--budget", "100GB", "-o", "all.json",
               cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((workdir / "all.json").read_text())
    data["policies"] = {k: "full" if i % 2 else "none" for i, k in enumerate(data["policies"])}
    data["budget_bytes"] = 2**40
    (workdir / "mixed.json").write_text(json.dumps(data))
    proc = run("validate", "--schedule", "mixed.json", "--scenario", "tiny.toml", "--steps", "1", "--json",
               cwd=workdir)
    assert proc.returncode == 1, proc.stderr  # edited by hand: the predictions are the old plan's
    result = json.loads(proc.stdout)
    assert result["edited"] and not result["ok"] and result["grads_equal"] and result["losses_equal"]
    del data["policies_sha256"]  # a schedule from an older memfit, or another tool: nothing to compare
    (workdir / "mixed.json").write_text(json.dumps(data))
    proc = run("validate", "--schedule", "mixed.json", "--scenario", "tiny.toml", "--steps", "1", "--json",
               cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"] and result["grads_equal"] and result["losses_equal"]
    data["budget_bytes"] = 1024  # the same schedule cannot fit 1 KiB: validate must fail (exit 1)
    (workdir / "tight.json").write_text(json.dumps(data))
    proc = run("validate", "--schedule", "tight.json", "--scenario", "tiny.toml", "--steps", "1", cwd=workdir)
    assert proc.returncode == 1 and "EXCEEDS" in proc.stdout
    train = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--schedule", "mixed.json",
                            "--scenario", "tiny.toml", "--steps", "2"], cwd=workdir, capture_output=True,
                           text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    assert "checkpointed units: h.1, h.3" in train.stdout
    losses = [float(line.split()[-1]) for line in train.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_help_and_scenarios(workdir):
    proc = run("plan", "--help", cwd=workdir)
    assert proc.returncode == 0 and "24GB" in proc.stdout and "examples:" in proc.stdout
    for command in ("plan", "validate", "sweep", "profile", "show", "scenarios"):  # each its own examples
        text = run(command, "--help", cwd=workdir).stdout
        examples = [line for line in text.split("examples:")[1].splitlines() if line.startswith("  memfit ")]
        assert examples and all(f"memfit {command} " in line + " " for line in examples), (command, examples)
    top = run("--help", cwd=workdir).stdout
    assert {"plan", "validate", "sweep", "show", "scenarios"} <= {line.split()[1] for line in top.splitlines()
                                                                 if line.startswith("  memfit ")}
    proc = run("scenarios", cwd=workdir)
    assert "gpt-750m (default)" in proc.stdout and "hf-llama" in proc.stdout and "estimated (rtx4090)" in proc.stdout
    # sizes counted on the meta device: Llama-2-7B's 6,738,415,616 parameters, gpt-small's 5,853,184
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line}
    assert "6.74B bfloat16" in rows["llama2-7b"] and "5.9M float32" in rows["gpt-small"]
    proc = run(cwd=workdir)
    assert proc.returncode == 2


def test_autocast_without_its_cache_on_the_command_line(workdir):
    """--no-autocast-cache (Lightning's mixed precision): planned, saved and validated so; a
    validate of the schedule rebuilds that step and measures the predicted peak."""
    proc = run("plan", "--scenario", "tiny.toml", "--precision", "amp-bf16", "--no-autocast-cache", "--budget", "4MB",
               "--repeat", "1", "-o", "nocache.json", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert memfit.load_schedule(workdir / "nocache.json").train_step.autocast_cache is False
    proc = run("validate", "--schedule", "nocache.json", "--scenario", "tiny.toml", "--steps", "1", "--json",
               cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["measured_peak_bytes"] == result["predicted_peak_bytes"], result
    proc = run("plan", "--scenario", "tiny.toml", "--no-autocast-cache", "--budget", "4MB", cwd=workdir)
    assert proc.returncode == 2 and "autocast_cache=False is a setting of autocast" in proc.stderr
