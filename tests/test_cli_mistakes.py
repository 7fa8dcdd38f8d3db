"""What a new user hits: each mistake exits 2 with one `memfit: error:` line and writes no file;
Ctrl-C always stops a run with 130; a schedule remembers what it was made for."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memfit
from memfit.planning.baselines import STRATEGIES
from memfit.policy import KEEP
from memfit.scenarios import tomllib  # tomllib or, on Python 3.10, tomli

from .conftest import TINY, random_profile, run_cli

ROOT = Path(__file__).resolve().parents[1]
USER_MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def mlp():  # returns only a model: needs --input-shape 4x10
    torch.manual_seed(0)
    return Net()


def frozen():
    model = mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def broken():
    size = 3
    raise ValueError(f"my factory cannot build size {size}")


def sized(batch=2, width=10):  # a factory with arguments, as users write one
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))
    return net, torch.randn(batch, width)
'''


def run_process(*args, cwd, timeout=300):
    """``python -m memfit.cli`` in a process of its own: for what only a process shows (a
    traceback, what is imported, Ctrl-C)."""
    return subprocess.run([sys.executable, "-m", "memfit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


run = run_cli  # in this process; run_process where only a process shows it


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("mistakes")
    (d / "tiny.toml").write_text(TINY)
    (d / "usermodels.py").write_text(USER_MODELS)
    proc = run("plan", "--scenario", "tiny.toml", "--repeat", "1", "--budget", "100GB", "-o", "idle.json", cwd=d)
    assert proc.returncode == 0, proc.stderr
    proc = run("profile", "--scenario", "tiny.toml", "--repeat", "1", "-o", "profile.json", cwd=d)
    assert proc.returncode == 0, proc.stderr
    random_profile(5, 0, chain=False).save(d / "nochain.json")
    return d


def _mid_budget(work: Path) -> int:
    prof = memfit.Profile.load(work / "profile.json")
    return (memfit.min_budget_bytes(prof) + memfit.predict(prof, {}).peak_bytes) // 2


def test_wheel_ships_the_builtin_scenarios():
    """pyproject.toml must map scenarios/ into the package and ship every file in it, or a wheel
    install has none (CI also installs the wheel and runs it: .ci/run); and every package of
    memfit must be listed, as the list is explicit."""
    from memfit.scenarios import BUILTIN_DIR

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["memfit.builtin_scenarios"] == "scenarios"
    assert BUILTIN_DIR == ROOT / "scenarios"  # a checkout reads the one copy at the top
    globs = config["package-data"]["memfit.builtin_scenarios"]
    shipped = {p for g in globs for p in (ROOT / "scenarios").glob(g)}
    builtin = set((ROOT / "scenarios").glob("*.toml"))
    assert builtin and builtin <= shipped
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "memfit").rglob("__init__.py")}
    assert packages | {"memfit.builtin_scenarios"} == set(config["packages"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--time-limit", "-1"], "--time-limit must be a positive number"),
        (["--time-limit", "nan"], "--time-limit must be a positive number"),
        (["--max-segment", "1"], "--max-segment must be at least 2"),
        (["--budget", "0.5"], "less than one byte"),
        (["--budget", "300Mb"], "in bits"),
        (["--units", "h.*"], "--units cannot change a profile"),
        (["--optimizer", "sgd"], "--optimizer cannot change a profile"),
        (["--repeat", "3"], "--repeat cannot change a profile"),
        (["--input-shape", "2x32"], "--input-shape cannot change a profile"),
        (["-o", "profile.json"], "would overwrite the profile"),
        (["-o", "."], "is a directory"),
        (["-o", ""], "name is empty"),
        (["-o", "profile.json/s.json"], "is a file, not a directory"),
        (["-o", "/proc/s.json"], "cannot write the schedule file there"),
        (["-o", "nope/dir/s.json"], "the directory nope/dir does not exist (create it first: mkdir -p nope/dir)"),
        (["--budget", "-1GB"], "a memory size must be positive, got '-1GB'"),
        (["--budget", "0%"], "a budget share must be more than 0% and at most 100% of the unplanned peak"),
        (["--budget", "sixty%"], "write a percentage such as 60%"),
    ],
)
def test_plan_mistakes_from_a_profile(work, args, message):
    budget = ["--budget", str(_mid_budget(work))] if "--budget" not in args else []
    before = sorted(p.name for p in work.iterdir())
    proc = run("plan", "--profile", "profile.json", *budget, *args, cwd=work)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("memfit: error:") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in work.iterdir()) == before  # no file written or changed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--budget", "1GB", "-o", "."], "is a directory"),
        (["plan", "--budget", "1GB", "-o", "/proc/memfit-test/s.json"], "cannot write"),
        (["profile", "-o", "tiny.toml/p.json"], "is a file, not a directory"),
    ],
)
def test_output_is_checked_before_profiling(work, args, message):
    proc = run(*args, "--scenario", "tiny.toml", cwd=work)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "building" not in proc.stderr  # refused before the model was even built


def test_sqrt_on_units_that_are_no_chain(work):
    proc = run("plan", "--profile", "nochain.json", "--budget", "1GB", "--strategy", "sqrt", "-o", "x.json", cwd=work)
    assert proc.returncode == 2 and "strategy sqrt does not apply" in proc.stderr, proc.stderr
    assert "no schedule fits" not in proc.stderr and not (work / "x.json").exists()
    prof = memfit.Profile.load(work / "nochain.json")
    budget = (memfit.min_budget_bytes(prof) + memfit.predict(prof, {}).peak_bytes) // 2
    proc = run("plan", "--profile", "nochain.json", "--budget", str(budget), "-o", "nochain-s.json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("sqrt(N) segments"))
    assert row.split()[-2:] == ["n/a", "-"]
    sched = json.loads((work / "nochain-s.json").read_text())
    assert sched["baselines"]["sqrt"] == {"applies": False, "fits": False}
    assert all(isinstance(b["fits"], bool) for b in sched["baselines"].values())  # booleans, not 1.0/0.0


def test_huge_budget_and_a_model_that_fits_unplanned(work):
    proc = run("plan", "--profile", "profile.json", "--budget", "1e40", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert "fits without checkpointing" in proc.stdout and "no schedule written" in proc.stdout
    assert not (work / "schedule.json").exists()
    sched = memfit.load_schedule(work / "idle.json")  # with -o given, the do-nothing schedule is written
    assert not sched.checkpointed


def test_every_k_includes_k_infinity():
    prof = random_profile(6, 3)
    assert set(STRATEGIES["every-k"](prof, 2**50).values()) == {KEEP}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "."], "is a directory"),
        (["plan", "--profile", ".", "--budget", "1GB"], "is a directory"),
        (["plan", "--budget", "1GB", "--device", "cuda"], "sees no CUDA GPU"),
        (["plan", "--budget", "1GB", "--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
        (["plan", "--budget", "1GB", "--scenario", "args5.toml"], "field 'args' must be a table"),
        (["plan", "--budget", "1GB", "--scenario", "shape.toml"], "field 'input_shape' must be a list"),
        (["plan", "--budget", "1GB", "--scenario", "tiny.toml", "--input-shape", "2x32"], "returns its own inputs"),
        (["plan", "--budget", "1GB", "--model", "usermodels:frozen", "--input-shape", "4x10"],
         "no trainable parameters"),
        (["plan", "--budget", "1GB", "--model", "usermodels:broken"],
         "ValueError in {work}/usermodels.py:{raise_line} (broken): my factory cannot build size 3"),
        (["plan", "--budget", "1GB", "--model", "usermodels:mlp", "--input-shape", "4x3"],
         "RuntimeError in {work}/usermodels.py:13 (forward): mat1 and mat2 shapes cannot be multiplied "
         "(4x3 and 10x10); does --input-shape 4x3 fit the model?"),
        (["plan", "--budget", "1GB", "--model", "usermodels:mlp", "--input-shape", "4x10", "--units", "nope"],
         "no module matches the unit pattern 'nope'"),
    ],
)
def test_more_mistakes_exit_2_without_traceback(work, args, message):
    (work / "args5.toml").write_text('model = "memfit.zoo:gpt"\nargs = 5\n')
    (work / "shape.toml").write_text('model = "memfit.zoo:gpt"\ninput_shape = [8, "x"]\n')
    proc = run(*args, cwd=work)
    assert proc.returncode == 2, proc.stderr
    raise_line = USER_MODELS.splitlines().index('    raise ValueError(f"my factory cannot build size {size}")') + 1
    assert message.format(work=work, raise_line=raise_line) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (work / "schedule.json").exists()


def test_debug_shows_the_users_traceback(work):
    proc = run_process("plan", "--budget", "1GB", "--model", "usermodels:mlp", "--input-shape", "4x3", "--debug",
                       cwd=work)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "mat1 and mat2" in proc.stderr


def test_validate_rebuilds_what_the_schedule_was_made_for(work):
    budget = _mid_budget(work)
    proc = run("plan", "--scenario", "tiny.toml", "--repeat", "1", "--budget", str(budget), "-o", "made.json",
               cwd=work)
    assert proc.returncode == 0, proc.stderr
    sched = memfit.load_schedule(work / "made.json")
    assert sched.source["scenario"] == str(work / "tiny.toml") and sched.optimizer == "adamw"
    assert sched.device == "cpu" and sched.checkpointed
    proc = run("validate", "--schedule", "made.json", "--steps", "1", cwd=work)  # no model flags: the file's own
    assert proc.returncode == 2 and "--trust-source to run what the file names" in proc.stderr, proc.stderr
    proc = run("validate", "--schedule", "made.json", "--steps", "1", "--json", "--timeline", "v.svg",
               "--trust-source", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert (work / "v.svg").read_text().lstrip().startswith("<?xml")
    assert "wrote v.svg" in proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"] and result["measured_peak_bytes"] == result["predicted_peak_bytes"]
    proc = run("validate", "--schedule", "made.json", "--steps", "1", "--scenario", "tiny.toml", cwd=work)
    assert proc.returncode == 0, proc.stderr  # the flags the schedule was made with are welcome
    data = json.loads((work / "made.json").read_text())
    del data["source"]
    (work / "nosource.json").write_text(json.dumps(data))
    proc = run("validate", "--schedule", "nosource.json", "--steps", "1", cwd=work)
    assert proc.returncode == 2 and "does not record which model" in proc.stderr, proc.stderr
    for args, message in [
        (["--optimizer", "sgd"], "planned with --optimizer adamw, not sgd"),
        (["--scenario", "gpt-small"], "made for --scenario " + str(work / "tiny.toml")),
        (["--scenario", "tiny.toml", "--units", "h.0", "h.1"], "with units auto, not --units h.0 h.1"),
        (["--units", "h.*"], "with units auto, not --units h.*"),
        (["--input-shape", "2x32"], "with input shape the factory's own inputs, not --input-shape 2x32"),
        (["--model", "usermodels:mlp"], "not --model usermodels:mlp"),
    ]:
        proc = run("validate", "--schedule", "made.json", "--steps", "1", *args, cwd=work)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_validate_api_refuses_another_optimizer_or_shape():
    from .conftest import tiny_gpt

    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1)
    sched = memfit.plan(prof, memfit.min_budget_bytes(prof) + 2**20)
    with pytest.raises(memfit.ScheduleMismatchError, match="optimizer 'adamw'"):
        memfit.validate(model, batch, sched, optimizer="sgd", steps=0)
    short = {k: v[:, :16] for k, v in batch.items()}
    with pytest.raises(memfit.ScheduleMismatchError, match="planned for inputs"):
        memfit.validate(model, short, sched, steps=0)


def test_files_follow_the_umask(tmp_path):
    prof = random_profile(3, 1)
    old = os.umask(0o027)
    try:
        memfit.plan(prof, memfit.predict(prof, {}).peak_bytes).save(tmp_path / "s.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "s.json").stat().st_mode) == 0o640


def test_show_has_no_solve_time_and_bad_schedules_do_not_load(work, tmp_path):
    proc = run("show", "idle.json", cwd=work)
    assert proc.returncode == 0 and " in 0.00 s" not in proc.stdout and "solver cpsat (optimal)" in proc.stdout
    data = json.loads((work / "idle.json").read_text())
    data["budget_bytes"] = -5
    (tmp_path / "neg.json").write_text(json.dumps(data))
    with pytest.raises(memfit.FileFormatError, match="'budget_bytes' must be at least 1"):
        memfit.load_schedule(tmp_path / "neg.json")


def test_dropped_interrupt_is_not_lost():
    """A KeyboardInterrupt raised inside a weakref callback is swallowed by Python; the
    handler's record still stops the run at the next check."""
    import weakref

    from memfit import console

    previous = signal.getsignal(signal.SIGINT)
    try:
        console.install_interrupt_handler()

        class Thing:
            pass

        thing = Thing()
        weakref.finalize(thing, signal.raise_signal, signal.SIGINT)
        del thing  # the finalizer runs here; its KeyboardInterrupt goes to the unraisable hook
        assert console.interrupted()
        with pytest.raises(KeyboardInterrupt):
            console.check_interrupt()
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = sys.__unraisablehook__


@pytest.mark.parametrize("delay", [0.0, 0.4, 1.0, 2.0, 3.5])
def test_ctrl_c_while_profiling_stops_with_130_and_no_file(work, delay):
    proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", "plan", "--scenario", "tiny.toml", "--repeat", "400",
                             "--budget", "1GB", "-o", f"int{delay}.json"], cwd=work, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("building")  # main() is running, the model being built
    time.sleep(delay)
    assert proc.poll() is None, "the run ended before the interrupt: make it longer"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not (work / f"int{delay}.json").exists()


def test_a_reader_that_stops_early_gets_no_traceback(work):
    """`memfit scenarios | head -1`: the pipe is closed before memfit writes."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", "scenarios"], cwd=work, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_outputs_never_replace_devices_or_foreign_files(work, tmp_path):
    (work / "notes.txt").write_text("mine")
    for target, message in [("/dev/null", "is not a regular file"), ("usermodels.py", "is not a memfit file"),
                            ("tiny.toml", "is not a memfit file"), ("notes.txt", "is not a memfit file")]:
        proc = run("plan", "--profile", "profile.json", "--budget", str(_mid_budget(work)), "-o", target, cwd=work)
        assert proc.returncode == 2 and message in proc.stderr, (target, proc.stderr)
    assert Path("/dev/null").is_char_device() and (work / "notes.txt").read_text() == "mine"
    (work / "real.json").unlink(missing_ok=True)
    (work / "link.json").unlink(missing_ok=True)
    (work / "link.json").symlink_to("real.json")
    proc = run("plan", "--profile", "profile.json", "--budget", str(_mid_budget(work)), "-o", "link.json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert (work / "link.json").is_symlink() and memfit.load_schedule(work / "real.json").checkpointed


@pytest.mark.parametrize(
    ("units", "message"),
    [(["h.3", "h.2", "h.1", "h.0"], "the units run in the order h.0, h.1, h.2, h.3, not as given"),
     (["h"], "unit 'h' never ran as a module in the forward pass")],
)
def test_units_must_run_in_the_order_given(work, units, message):
    proc = run("profile", "--scenario", "tiny.toml", "--repeat", "1", "--units", *units, "-o", "u.json", cwd=work)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (work / "u.json").exists()


def test_dp_refuses_units_it_cannot_model_exactly():
    cnn = memfit.Profile.load(ROOT / "tests" / "fixtures" / "cnn-mixed.json")  # BatchNorm: nets differ by role
    with pytest.raises(memfit.MemfitError, match="dp solver is exact only"):
        memfit.plan(cnn, memfit.predict(cnn, {}).peak_bytes, solver="dp")


@pytest.mark.parametrize(
    ("kind", "mutate", "message"),
    [
        ("schedule", lambda d: d.update(baselines="x"), "'baselines' must be an object"),
        ("schedule", lambda d: d["baselines"].update(full="x"), "field 'baselines' gives 'full'"),
        ("schedule", lambda d: d["source"].update(units=5), "'source.units'"),
        ("schedule", lambda d: d.update(budget_bytes=10**400), "out of range"),
        ("profile", lambda d: d.update(step_s=0), "'step_s' has an invalid value 0"),
        ("profile", lambda d: d.update(phases=[]), "has no phases"),
        ("profile", lambda d: d["units"][1].update(name=d["units"][0]["name"]), "names repeat"),
        ("profile", lambda d: d.update(optimizer="lion"), "'optimizer' has an invalid value 'lion'"),
        ("profile", lambda d: d.update(chain="yes"), "'chain' has an invalid value 'yes'"),
        ("profile", lambda d: d["units"][0].update(fwd_s=-1.0), "'fwd_s' must be a finite number of at least 0"),
    ],
)
def test_corrupt_files_are_named_not_traced(work, tmp_path, kind, mutate, message):
    source = work / ("idle.json" if kind == "schedule" else "profile.json")
    data = json.loads(source.read_text())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(memfit.FileFormatError, match=message):
        memfit.load_schedule(path) if kind == "schedule" else memfit.Profile.load(path)


def test_deeply_nested_json_is_a_format_error(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(memfit.FileFormatError, match="not a memfit file"):
        memfit.load_schedule(tmp_path / "deep.json")


def test_nan_losses_compare_equal():
    import torch

    from memfit.steps.validate import _same

    nan = float("nan")
    assert _same(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert not _same(torch.tensor([1.0]), torch.tensor([1.0 + 1e-6]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan"], "memfit: error: the following arguments are required: --budget (see memfit plan --help)"),
        (["plan", "--budget", "1e400"], "is too large"),
        (["plan", "--budget", "0.1B"], "did you mean 0.1GB?"),
        (["plan", "--budget", "1GB", "--strategy", "sqrt", "--no-segments"], "--no-segments rules out"),
        (["plan", "--budget", "1GB", "--device", "cpu:1"], "--device must be cpu"),
        (["plan", "--budget", "1GB", "--model", "nosuch.py:mlp"], "nosuch.py: no such model file"),
        (["plan", "--budget", "1GB", "--scenario", "tiny.toml", "--parallel", "fsdp", "--world-size", "0"],
         "--world-size must be at least 2 for fsdp, got 0"),
    ],
)
def test_usage_mistakes_are_one_line(work, args, message):
    proc = run(*args, cwd=work)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("memfit: error:") and message in proc.stderr
    said = [line for line in proc.stderr.strip().splitlines() if not line.startswith("building ")]  # progress
    assert len(said) == 1, proc.stderr


MARKER_MODULE = '''
from pathlib import Path

Path(__file__).with_name("imported.marker").write_text("this module ran")
from usermodels import mlp  # noqa: E402,F401
'''


def test_a_file_does_not_decide_what_code_runs(work, tmp_path):
    """A shared schedule or profile whose source names a module (or a scenario file) outside the
    built-ins: validate, plan --compile and sweep --measure import nothing without the model
    named on the command line or --trust-source (the module writes a marker when imported)."""
    (work / "marker_mod.py").write_text(MARKER_MODULE)
    marker = work / "imported.marker"
    sched = json.loads((work / "idle.json").read_text())
    sched["source"] = {"model": "marker_mod:mlp", "input_shape": [4, 10], "units": "auto", "dtype": "float32"}
    (work / "shared.json").write_text(json.dumps(sched))
    toml = tmp_path / "elsewhere.toml"
    toml.write_text('model = "marker_mod:mlp"\ninput_shape = [4, 10]\n')
    prof = json.loads((work / "profile.json").read_text())
    prof["source"] = {"scenario": str(toml), "units": "auto", "dtype": "float32"}
    (work / "shared-profile.json").write_text(json.dumps(prof))
    for args in (["validate", "--schedule", "shared.json", "--steps", "1"],
                 ["plan", "--profile", "shared-profile.json", "--budget", "1GB", "--compile", "aot_eager"],
                 ["sweep", "--profile", "shared-profile.json", "--measure", "--points", "2"]):
        proc = run(*args, cwd=work)
        assert proc.returncode == 2 and "--trust-source" in proc.stderr, proc.stderr
        assert "--model marker_mod:mlp" in proc.stderr or f"--scenario {toml}" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not marker.exists(), args
    proc = run("validate", "--schedule", "shared.json", "--steps", "1", "--trust-source", cwd=work)
    assert marker.exists()  # asked for: the file's model is rebuilt (and here is another model than planned)
    assert proc.returncode == 2 and "planned for inputs" in proc.stderr, proc.stderr  # not what the file says


def test_missing_optional_packages_are_named_before_any_work(work, monkeypatch, capsys):
    """No matplotlib: --plot and --timeline are refused before profiling (which can take minutes);
    no transformers: `memfit scenarios` says the Hugging Face scenarios need it."""
    from memfit.cli import main

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled before checking the plot's dependency")

    monkeypatch.setattr("memfit.profiler.profile", no_profiling)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.chdir(work)
    for args in (["sweep", "--scenario", "tiny.toml", "--plot", "c.png"],
                 ["plan", "--scenario", "tiny.toml", "--budget", "1GB", "--timeline", "t.png"]):
        assert main(args) == 2
        assert "plots need matplotlib: pip install 'memfit[plot]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("hf-gpt2", "gpt-small"))}
    assert "needs transformers" in rows["hf-gpt2"] and "needs" not in rows["gpt-small"]
    assert "pip install 'memfit[hf]'" in out


def test_a_fits_answer_writes_nothing_unasked_and_says_what_the_device_leaves(tmp_path):
    """A model that fits: nothing is written unasked (no schedule, no profile), the range where
    checkpointing matters is printed with how to keep the profile; --save-profile keeps it (also
    when no plan meets the budget), and is refused with --profile; an estimate whose budget is
    more than the GPU leaves after its CUDA context and allocator margin says so, as a plan does."""
    (tmp_path / "tiny.toml").write_text(TINY)
    proc = run("plan", "--scenario", "tiny.toml", "--repeat", "1", "--budget", "100GB", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "checkpointing matters between" in proc.stdout and "add --save-profile FILE" in proc.stdout, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.toml"]
    proc = run("plan", "--scenario", "tiny.toml", "--repeat", "1", "--budget", "1KB", "--save-profile",
               "profile.json", cwd=tmp_path)  # a budget no plan meets still leaves the profile it took
    assert proc.returncode == 2 and "smallest budget" in proc.stderr and "wrote profile.json" in proc.stderr
    prof = memfit.Profile.load(tmp_path / "profile.json")
    low = memfit.min_budget_bytes(prof)
    assert memfit.format_bytes(low) in proc.stderr
    proc = run("plan", "--profile", "profile.json", "--budget", str(low), cwd=tmp_path)  # no profiling again
    assert proc.returncode == 0 and "wrote schedule.json" in proc.stdout, proc.stderr
    proc = run("plan", "--scenario", "tiny.toml", "--target", "t4", "--budget", "30GB", cwd=tmp_path)  # fits a T4
    assert proc.returncode == 0, proc.stderr
    assert "fits without checkpointing" in proc.stdout and "estimated for Tesla T4 (t4)" in proc.stdout
    assert "device memory: 12.73 GiB usable on Tesla T4" in proc.stdout
    assert "the budget asked for, 30.00 GiB, is more than that: planned for 12.73 GiB" in proc.stdout
    proc = run("plan", "--profile", "profile.json", "--budget", "1GB", "--save-profile", "p2.json", cwd=tmp_path)
    assert proc.returncode == 2 and "drop one of them" in proc.stderr and not (tmp_path / "p2.json").exists()
    proc = run("plan", "--scenario", "tiny.toml", "--budget", "1GB", "-o", "same.json", "--save-profile", "./same.json",
               cwd=tmp_path)  # refused before any profiling
    assert proc.returncode == 2 and "-o and --save-profile both name ./same.json" in proc.stderr, proc.stderr


def test_ctrl_c_in_a_parallel_run_prints_no_rank_tracebacks(work):
    """Ctrl-C at a terminal reaches the whole process group, spawned ranks included: the run stops
    with 130 and one line, not the ranks' KeyboardInterrupt tracebacks."""
    proc = subprocess.Popen([sys.executable, "-m", "memfit.cli", "plan", "--scenario", "tiny.toml", "--repeat", "400",
                             "--budget", "1GB", "--parallel", "ddp", "-o", "ranks-int.json"], cwd=work,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(12)  # the ranks are spawned and profiling
    assert proc.poll() is None, "the run ended before the interrupt: make it longer"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not (work / "ranks-int.json").exists()


def test_compile_with_an_estimate_is_refused_at_once(tmp_path):
    """--compile measures the compiled step: with --target (or the default, estimated here) it
    is refused before estimating, and an unknown backend lists the usable ones only."""
    start = time.monotonic()
    for args in (["--compile", "aot_eager"], ["--scenario", "gpt-small", "--target", "h100", "--compile", "eager"]):
        proc = run("plan", "--budget", "1GB", *args, cwd=tmp_path)
        assert proc.returncode == 2 and "--compile measures the compiled step, which needs the device" in proc.stderr
    assert time.monotonic() - start < 60  # no estimate ran (the default's takes minutes with a compile)
    proc = run("plan", "--budget", "1GB", "--compile", "nosuch", cwd=tmp_path)
    assert proc.returncode == 2 and "aot_eager" in proc.stderr and "TESTING" not in proc.stderr


def test_a_model_by_file_path_and_a_scenario_beside_its_module(work, tmp_path):
    """--model mymodels.py:mlp (a path, what most people try first) works; a scenario file's
    model = "mymodule:fn" is found beside the TOML, from any working directory."""
    proc = run("plan", "--model", "usermodels.py:mlp", "--input-shape", "4x10", "--repeat", "1", "--budget", "1GB",
               cwd=work)
    assert proc.returncode == 0 and "fits without checkpointing" in proc.stdout, proc.stderr
    proc = run("plan", "--model", str(work / "usermodels.py") + ":mlp", "--input-shape", "4x10", "--repeat", "1",
               "--budget", "1GB", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    models = tmp_path / "models"
    models.mkdir()
    (models / "beside.py").write_text(USER_MODELS)
    (models / "net.toml").write_text('model = "beside:mlp"\ninput_shape = [4, 10]\n')
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    proc = run("plan", "--scenario", str(models / "net.toml"), "--repeat", "1", "--budget", "1GB", cwd=elsewhere)
    assert proc.returncode == 0 and "fits without checkpointing" in proc.stdout, proc.stderr


def test_usage_errors_and_plans_from_a_profile_answer_without_torch(tmp_path):
    """A mistake is answered before torch is imported (seconds of a 2-core machine), and so is
    a plan from a profile file, which needs only the solver."""
    fixture = str(ROOT / "tests" / "fixtures" / "gpt-small.json")
    script = ("import sys\nfrom memfit.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
              "except SystemExit as e:\n    code = e.code\nprint('TORCH', 'torch' in sys.modules, code)")
    for argv, code in ((["sweep", "--budgets", "5:1:1"], 2), (["plan", "--budget", "12QB"], 2),
                       (["validate", "--schedule", "none.json"], 2), (["plan", "--help"], 0),
                       (["plan", "--profile", fixture, "--budget", "200MB", "-o", str(tmp_path / "s.json")], 0)):
        proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120)
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        assert last == f"TORCH False {code}", (argv, proc.stderr)
    assert (tmp_path / "s.json").exists()
    # the plan's table: sqrt(N) does not fit 200 MB on this fixture and shows its tightest peak, marked
    rows = {line[:24].strip(): line for line in proc.stdout.splitlines()}
    assert "216.14 MiB *  no" in rows["sqrt(N) segments"] and "*: the strategy does not fit" in proc.stdout


def test_a_broken_invariant_is_a_bug_report_not_a_user_error(monkeypatch, tmp_path, capsys):
    """A plan whose prediction exceeds its own budget cannot be the user's doing: InternalError,
    not a MemfitError; the CLI shows the traceback, asks for a report and exits 70."""
    from memfit.cli import main
    from memfit.planning import planner

    real = planner.predict

    def over(profile, policies):
        p = real(profile, policies)
        p.peak_bytes += 2**40
        return p

    monkeypatch.setattr(planner, "predict", over)
    fixture = str(ROOT / "tests" / "fixtures" / "gpt-small.json")
    assert not issubclass(memfit.InternalError, memfit.MemfitError)
    code = main(["plan", "--profile", fixture, "--budget", "400MB", "-o", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert code == 70 and "Traceback (most recent call last)" in err and "InternalError" in err
    assert "a bug in memfit rather than a mistake of yours" in err and "please report it" in err
    assert not (tmp_path / "s.json").exists()


def test_a_budget_as_a_share_of_the_unplanned_peak_and_a_schedule_replaced_says_so(work):
    """``--budget 90%``, as torch.compile's users write its memory budget: 90% of the unplanned
    peak the profile predicts. Writing over a schedule made for another model is said, not silent."""
    prof = memfit.Profile.load(work / "profile.json")
    other = work / "other.json"
    memfit.plan(random_profile(4, 0, chain=True), 10**12).save(other)  # another model's schedule
    proc = run("plan", "--profile", "profile.json", "--budget", "90%", "-o", "other.json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    budget = round(0.9 * memfit.predict(prof, {}).peak_bytes)
    assert memfit.load_schedule(other).budget_bytes == budget
    assert "budget 90% of the unplanned peak" in proc.stdout
    assert "other.json was a schedule for" in proc.stderr and "replaced by this one" in proc.stderr
    again = run("plan", "--profile", "profile.json", "--budget", "90%", "-o", "other.json", cwd=work)
    assert again.returncode == 0 and "replaced" not in again.stderr  # the same model's: no note
    other.unlink()


def test_a_factorys_arguments_from_the_command_line(work):
    """``--args`` sets a factory's keyword arguments, typed as a scenario's [args]: the profile is of
    the batch and width given, not the factory's defaults; mistakes exit 2 saying what to write."""
    proc = run("profile", "--model", "usermodels:sized", "--args", "batch=8", "width=32", "--repeat", "1",
               "-o", "sized.json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert memfit.Profile.load(work / "sized.json").input_shapes == "float32[8,32]"
    (work / "sized.json").unlink()
    for args, says in ((["batch8"], "write NAME=VALUE, e.g. --args batch=64 image=1024"),
                       (["bacth=8"], "unexpected keyword argument 'bacth'")):
        proc = run("plan", "--model", "usermodels:sized", "--args", *args, "--budget", "1GB", cwd=work)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_folder_named_memfit_in_the_working_directory_is_named_as_the_trouble(tmp_path):
    """``-o memfit/schedule.json`` made a folder that hides the package from a train.py run beside it
    (Python finds the folder first: "module 'memfit' has no attribute 'apply'"): every command run
    there says so and what to do; the package's own folder (a checkout) is not warned about. Run
    as a user runs it, in a process of its own (a test that changed its own working directory
    would leave it in multiprocessing's ORIGINAL_DIR, which spawned ranks put on their sys.path)."""
    from memfit.cli import shadowing_folder

    (tmp_path / "memfit").mkdir()
    (tmp_path / "memfit" / "__init__.py").write_text("")  # hides an installed wheel too (a bare folder: editable)
    proc = subprocess.run([str(Path(sys.executable).parent / "memfit"), "scenarios"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "gpt-750m" in proc.stdout, proc.stderr
    assert "memfit: warning: the folder" in proc.stderr and "rename the folder" in proc.stderr
    assert "no memfit.apply" in proc.stderr
    assert shadowing_folder(Path(memfit.__file__).resolve().parent.parent) is None  # a checkout's own
    shadowed = subprocess.run([sys.executable, "-c", "import memfit; memfit.apply"], cwd=tmp_path,
                              capture_output=True, text=True)
    assert shadowed.returncode != 0 and "memfit" in shadowed.stderr  # the trouble the warning names
