"""A scheduled model under torch.compile: the plain model's results, real recomputation, and a
plan whose measured compiled peak fits its budget."""

import copy
import functools
import json
import shutil
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import memfit
from memfit import zoo
from memfit.formats.schedule import load_schedule
from memfit.policy import FULL, KEEP, Children, Segment, parse
from memfit.runtime import watch
from memfit.runtime.apply import set_policies
from memfit.runtime.harness import measure_steps
from memfit.steps.compiled import compiled_figures, compiled_peak, plan_compiled
from memfit.units import find_units

from .conftest import TINY, kw_net, tiny_gpt
from .test_apply import PATTERNS, _assert_identical, _run, _schedule, _small_cnn


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:memfit. this .* runs under torch.compile")  # an eager plan, compiled on purpose
@pytest.mark.parametrize("pattern", ["full", "mixed", "segments"])
@pytest.mark.parametrize("factory", [tiny_gpt, kw_net, _small_cnn], ids=["gpt-dropout", "kwargs-tuple", "cnn-bn"])
def test_compiled_schedule_gives_the_plain_models_results(factory, pattern):
    """aot_eager runs the same kernels as eager: losses, outputs, gradients, weights and
    BatchNorm buffers are bit for bit the plain eager model's, dropout included."""
    model, inputs = factory()
    if pattern == "segments" and factory is kw_net:
        pytest.skip("segments need a chain of single-tensor units")
    names = find_units(model, "auto")[:4]
    twin = copy.deepcopy(model)
    policies = {n: parse(p.format(*names)) for n, p in zip(names, PATTERNS[pattern], strict=True)}
    memfit.apply(twin, _schedule(model, policies))
    twin.compile(backend="aot_eager")  # in place: names stay
    _assert_identical(_run(model, inputs), _run(twin, inputs))


@pytest.mark.filterwarnings("ignore:memfit. this .* runs under torch.compile")  # an eager plan, compiled on purpose
@pytest.mark.parametrize("factory, level", [(tiny_gpt, "derive:all"), (_small_cnn, "derive"),
                                            (lambda: zoo.nanogpt(batch=2, seq=32, vocab=128, d_model=32, n_head=4,
                                                                 n_layer=3), "derive:products")],
                         ids=["gpt-dropout", "cnn-bn", "nanogpt"])
def test_compiled_derive_trains_as_the_plain_model(factory, level):
    """``derive`` compiled (its level a selective-checkpoint policy, runtime/unit_forward.py),
    trained by a user's loop of SGD steps: losses, outputs, gradients, weights and BatchNorm
    buffers bit for bit the plain eager model's, dropout included (its draws are kept)."""
    model, inputs = factory()
    names = find_units(model, "auto")[:4]
    twin = copy.deepcopy(model)
    memfit.apply(twin, _schedule(model, dict.fromkeys(names, parse(level))))
    twin.compile(backend="aot_eager")
    _assert_identical(_run(model, inputs), _run(twin, inputs))


def test_compiled_step_checkpoints_as_hand_written_checkpoint_does():
    """Before, Dynamo traced through the region hooks and checkpointed nothing: the compiled
    peak equalled the plain one. Now it equals that of the same blocks wrapped by hand in
    torch.utils.checkpoint and compiled, and is far below the plain compiled peak."""
    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    plain = compiled_peak(model, batch, {}, "aot_eager", optimizer=None)
    full = compiled_peak(model, batch, dict.fromkeys(names, FULL), "aot_eager", optimizer=None)
    by_hand, _ = tiny_gpt()
    for name in names:
        block = by_hand.get_submodule(name)
        block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=False)
    assert compiled_peak(by_hand, batch, {}, "aot_eager", optimizer=None) == full
    assert full < 0.7 * plain


def test_hooks_under_compile_see_the_plain_models_tensors():
    def record(model):
        seen = []
        for name in find_units(model, "auto"):
            model.get_submodule(name).register_forward_hook(lambda m, a, o, n=name: seen.append((n, o.detach().sum())))
        return seen

    plain, batch = tiny_gpt()
    model, _ = tiny_gpt()
    expected, got = record(plain), record(model)
    names = find_units(model, "auto")
    set_policies(model, {n: parse("segment:h.0..h.2") if n != "h.3" else FULL for n in names})
    torch.manual_seed(1)
    memfit.default_loss(torch.compile(plain, backend="aot_eager")(**batch)).backward()
    torch.manual_seed(1)
    memfit.default_loss(torch.compile(model, backend="aot_eager")(**batch)).backward()
    assert [n for n, _ in got] == [n for n, _ in expected] == names
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))


def test_tighten_and_remove_under_compile():
    """tighten switches a compiled model's plan (Dynamo compiles it again: its guards see the new
    forwards), and remove restores the plain forward."""
    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    schedule = _schedule(model, dict.fromkeys(names, KEEP))
    schedule.fallbacks = [{"budget_bytes": 1, "policies": dict.fromkeys(names, FULL), "predicted_peak_bytes": 0,
                           "predicted_recompute_s": 0.0, "predicted_overhead": 0.0}]
    memfit.apply(model, schedule)
    before = measure_steps(model, batch, optimizer=None, compile="aot_eager")
    assert memfit.tighten(model)
    after = measure_steps(model, batch, optimizer=None, compile="aot_eager")
    assert after.peak_bytes < before.peak_bytes
    assert all(torch.equal(after.grads[n], g) for n, g in before.grads.items())
    memfit.remove(model)
    assert not any("forward" in model.get_submodule(n).__dict__ for n in names)
    again = measure_steps(model, batch, optimizer=None, compile="aot_eager")
    assert again.peak_bytes == before.peak_bytes


def test_an_instance_forward_survives_apply_and_remove():
    """A forward set on the instance (as accelerate's hooks do) is the one the unit runs."""
    model, batch = tiny_gpt()
    block = model.h[1]
    calls = []

    def forward(x):
        calls.append(1)
        return type(block).forward(block, x)

    block.forward = forward
    memfit.apply(model, _schedule(model, dict.fromkeys(find_units(model, "auto"), FULL)))
    memfit.default_loss(model(**batch)).backward()
    memfit.remove(model)
    assert block.__dict__["forward"] is forward
    assert len(calls) == 2  # the forward and its recomputation


def test_plan_compiled_fits_its_budget_and_validates(gpt_profile):
    model, batch = tiny_gpt()
    plain = compiled_peak(model, batch, {}, "aot_eager")
    budget = (plain + gpt_profile.baseline_bytes) // 2 + plain // 4
    schedule = plan_compiled(model, batch, gpt_profile, budget, "aot_eager", finalists=0)  # memfit's own plan
    assert schedule.compile["backend"] == "aot_eager"
    assert schedule.compile["peak_bytes"] <= budget == schedule.budget_bytes
    assert schedule.checkpointed and not any(isinstance(p, Segment) for p in schedule.policies.values())
    v = memfit.validate(model, batch, schedule, steps=0)
    assert v.compile == "aot_eager" and v.ok
    assert v.measured_peak_bytes == v.predicted_peak_bytes == schedule.compile["peak_bytes"]
    with pytest.raises(memfit.InfeasibleBudgetError, match="compiled"):
        plan_compiled(model, batch, gpt_profile, gpt_profile.baseline_bytes, "aot_eager")


def test_plan_compiled_times_its_finalists_and_keeps_the_fastest():
    """Beside the plan from the compiled figures, plans without one of its finer options are
    measured compiled; each that fits is timed against it in an interleaved series and the
    fastest is returned, with its own measured peak (validate agrees to the byte); ``finalists=0`` gives
    the plan from the figures alone."""
    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1, granularity="fine")
    levels = [parse(o) for o in ("derive@mlp", "derive:all")]
    figures = compiled_figures(model, batch, prof, "aot_eager", options=levels, rounds=0)
    plain, least = figures.measured_peak_bytes[KEEP], figures.measured_peak_bytes[levels[-1]]
    budget = (plain + least) // 2
    first = plan_compiled(model, batch, prof, budget, "aot_eager", granularity="fine", figures=figures, finalists=0)
    said: list[str] = []
    chosen = plan_compiled(model, batch, prof, budget, "aot_eager", granularity="fine", figures=figures,
                           progress=said.append, compiler_budget=False)  # memfit's own (and test_compiled_budget)
    timed = [m for m in said if m.startswith("timed ")]
    assert len(timed) == 1, said  # at this budget a plan without one of the first's options fits
    ratios = [float(r.removesuffix("%")) for r in timed[0].split(": ")[1].split(", ")]
    assert len(ratios) >= 2 and ratios[0] == 0.0
    assert (chosen.policies == first.policies) == (min(ratios) == 0.0)  # the fastest measured, or the first
    assert chosen.compile["peak_bytes"] <= budget == chosen.budget_bytes
    v = memfit.validate(model, batch, chosen, steps=0)
    assert v.ok and v.measured_peak_bytes == chosen.compile["peak_bytes"]


def test_compiled_figures_price_options_by_the_compiled_step(gpt_profile):
    """Times moved to the compiled step's: ``full`` on every block timed compiled against the
    plain compiled step, its cost split over the blocks in their eager shares, the step the plain
    compiled one; memory alone (``rounds=0``) leaves the eager times."""
    model, batch = tiny_gpt()
    timed = compiled_figures(model, batch, gpt_profile, "aot_eager", rounds=3)
    untimed = compiled_figures(model, batch, gpt_profile, "aot_eager", rounds=0)
    eager = [u.options[FULL].recompute_s for u in gpt_profile.units]
    moved = [u.options[FULL].recompute_s for u in timed.units]
    assert [u.options[FULL].recompute_s for u in untimed.units] == eager and untimed.step_s == gpt_profile.step_s
    assert timed.step_s != gpt_profile.step_s and sum(moved) > 0  # recomputing every block costs, compiled too
    assert moved == pytest.approx([e / sum(eager) * sum(moved) for e in eager])
    assert all(u.options[FULL].recompute_uncertainty_s > 0 for u in timed.units)
    assert all(u.options[KEEP].recompute_s == 0 for u in timed.units)


def test_compiled_figures_predict_the_compiled_step():
    """The partitioner keeps other tensors than eager autograd (on this ViT the plain compiled
    step keeps more, a chain of leaf children frees nothing compiled): the profile's figures moved
    to the compiled step's (one compilation per option, four here) predict compiled plans that mix options
    within 2% of their measured compiled peak, nearer than the eager figures, which fall short
    (under-predict) on each."""
    pytest.importorskip("transformers")
    from .test_fine import _vit

    model, inputs = _vit()
    prof = memfit.profile(model, inputs, repeat=1, granularity="fine")
    chain = next(o for o in prof.units[0].options if isinstance(o, Children))
    others = (FULL, chain, parse("derive:all"))
    compiled = compiled_figures(model, inputs, prof, "aot_eager", options=others, rounds=0)
    assert compiled.units[0].options[KEEP].stored_bytes != prof.units[0].options[KEEP].stored_bytes
    plain = compiled_peak(model, inputs, {}, "aot_eager")
    assert compiled.measured_peak_bytes[KEEP] == plain == memfit.predict(compiled, {}).peak_bytes
    for other in others:
        mixed = {n: other if k % 2 else KEEP for k, n in enumerate(prof.unit_names)}
        measured = compiled_peak(model, inputs, mixed, "aot_eager")
        eager, moved = (memfit.predict(p, mixed).peak_bytes - measured for p in (prof, compiled))
        assert abs(moved) <= 0.02 * measured and abs(moved) < abs(eager), (other, eager, moved)
        assert eager < 0, other


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_inductor_checkpoints_with_plain_gradients():
    """inductor fuses, so its results are compared with the plain compiled model's, to float
    tolerance. In the slow set: its C++ kernels take 40 s to build on 2 cores, and memfit's side
    of a compiled step (the checkpoint HOP, the partitioner) is the same under aot_eager, which
    the suite's other compile tests run."""
    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    runs = {}
    for kind, policies in {"plain": {}, "full": dict.fromkeys(names, FULL)}.items():
        m, _ = tiny_gpt()
        set_policies(m, policies)
        runs[kind] = measure_steps(m, batch, optimizer=None, compile="inductor")
    assert runs["full"].peak_bytes < runs["plain"].peak_bytes
    # Mostly bit for bit; now and then a fused reduction sums in another order (1 run in 5 of this file).
    torch.testing.assert_close(runs["full"].losses, runs["plain"].losses)
    torch.testing.assert_close(runs["full"].grads, runs["plain"].grads)


def test_cli_plan_and_validate_compiled(tmp_path, capsys):
    from memfit.cli import main

    out = tmp_path / "s.json"
    (tmp_path / "tiny.toml").write_text(TINY)
    assert main(["plan", "--scenario", str(tmp_path / "tiny.toml"), "--budget", "3.8MB", "--compile", "aot_eager",
                 "--repeat", "1", "-o", str(out)]) == 0
    schedule = load_schedule(out)
    assert schedule.compile["backend"] == "aot_eager" and schedule.compile["peak_bytes"] <= 3.8 * 2**20
    said = capsys.readouterr()
    assert "torch.compile(model, backend=memfit.compile_backend(schedule))" in said.out  # the budget goes with it
    assert "the compiler's own plan at memory budget" in said.err  # timed beside memfit's
    assert main(["validate", "--schedule", str(out), "--steps", "1", "--json", "--trust-source"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["compile"] == "aot_eager" and result["measured_peak_bytes"] == schedule.compile["peak_bytes"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--compile", "nope"], "unknown torch.compile backend 'nope'; use one of"),
    (["--compile", "aot_eager", "--fallbacks", "2"], "--fallbacks is planned for the eager step only"),
    (["--compile", "aot_eager", "--strategy", "sqrt"], "--compile rules out --strategy sqrt"),
    (["--no-compiler-budget"], "--no-compiler-budget is a choice of compiled planning: give --compile"),
])
def test_cli_compile_mistakes_stop_before_profiling(extra, message, capsys):
    from memfit.cli import main

    assert main(["plan", "--budget", "300MB", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "profiling" not in err


def _compile_warnings(model, batch, steps=2):
    out = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            memfit.default_loss(model(**batch)).backward()
        out.append([str(w.message) for w in seen if issubclass(w.category, memfit.MemfitWarning)])
    return out


def test_an_eager_schedule_run_compiled_warns_once(monkeypatch):
    """An eager plan does not hold for the compiled step (the partitioner saves other tensors);
    a model compiled over it says so once, from inside the compiled forward (fullgraph holds),
    and a schedule planned for compilation, or the eager model, says nothing."""
    monkeypatch.setattr(watch, "_SAID", set())
    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    memfit.apply(model, _schedule(model, dict.fromkeys(names, FULL)))
    eager = _compile_warnings(model, batch, steps=1)
    compiled = _compile_warnings(torch.compile(model, backend="aot_eager", fullgraph=True), batch)
    assert eager == [[]]
    assert len(compiled[0]) == 1 and "runs under torch.compile" in compiled[0][0]
    assert "memfit plan --compile" in compiled[0][0] and compiled[1] == []

    torch._dynamo.reset()
    planned, _ = tiny_gpt()
    schedule = _schedule(planned, dict.fromkeys(names, FULL))
    schedule.compile = {"backend": "aot_eager", "peak_bytes": 1}
    memfit.apply(planned, schedule)
    assert _compile_warnings(torch.compile(planned, backend="aot_eager"), batch) == [[], []]
