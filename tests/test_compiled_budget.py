"""The compiler's own activation memory budget as a compiled plan: found by bisection, measured,
kept only with the plain step's gradients, recorded in the schedule and compiled again from it."""

import copy
import dataclasses
import itertools

import pytest
import torch

import memfit
from memfit.formats.schedule import load_schedule
from memfit.policy import KEEP
from memfit.runtime.harness import StepHarness
from memfit.steps.compiled import _compilers_own, compiled_peak
from memfit.steps.compiled_budget import budgets, compiler, largest_fitting
from memfit.steps.compiled_steps import CompiledSteps
from memfit.steps.validate import agreement
from memfit.zoo import gpt


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gpt(dropout: float):
    return gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=4, dropout=dropout)


def _first_plan(model, batch, budget: int | None = None):
    """A plan to time the compiler's against: every block ``full``, its budget ``budget`` (by
    default halfway between its compiled peak and the plain one). Its budget, policies and
    predicted slowdown are all ``_compilers_own`` reads of it."""
    prof = memfit.profile(model, batch, repeat=1)
    first = memfit.plan(prof, "1TB", strategy="full")
    if budget is None:
        plain = compiled_peak(model, batch, {}, "aot_eager")
        budget = (plain + compiled_peak(model, batch, first.policies, "aot_eager")) // 2
    first.budget_bytes = budget
    return first, prof


@pytest.mark.parametrize("steps", list(itertools.product(range(4), repeat=3)))
def test_bisection_finds_the_largest_fitting_budget_where_peaks_fall_with_the_budget(steps):
    """On every non-increasing staircase of peaks (here drops of 0..3 at three places), the budget
    found is the largest that fits, with at most five measurements; none where none fits."""
    grid = budgets()
    assert grid[0] == 0.05 and grid[-1] == 0.95 and len(grid) == 19
    cuts = [3, 9, 15]

    def peak_of(b: float) -> int:
        return 10 + sum(d for c, d in zip(cuts, steps, strict=True) if grid.index(b) >= c)

    asked: list[float] = []

    def measured(b: float) -> int:
        asked.append(b)
        return peak_of(b)

    for target in range(8, 22):
        asked.clear()
        found = largest_fitting(measured, target)
        fitting = [b for b in grid if peak_of(b) <= target]
        assert found == ((fitting[-1], peak_of(fitting[-1])) if fitting else None)
        assert len(asked) <= 5


def test_the_compilers_own_plan_fits_is_recorded_and_compiles_again_from_the_schedule(tmp_path):
    """Without dropout: the compiler's own plan is the largest budget bisection finds under the
    first plan's budget, measured to fit; validate runs it under that budget and measures the
    recorded peak to the byte with the plain gradients; the budget survives the file, and
    ``compile_backend`` gives a backend that compiles to the same peak."""
    model, batch = _gpt(0.0)
    first, prof = _first_plan(model, batch)
    budget = first.budget_bytes
    said: list[str] = []
    with CompiledSteps(model, batch, "aot_eager", versions=12) as compiled:
        ratio, own = _compilers_own(compiled, first, prof.step_s, model, "aot_eager", said.append)
    b = own.compile["memory_budget"]
    assert own.strategy == "compiler" and all(p == KEEP for p in own.policies.values())
    assert own.compile["peak_bytes"] <= budget == own.budget_bytes and ratio > 0
    probed = [float(m.rsplit(" ", 1)[1]) for m in said if "compiler's own plan at memory budget" in m]
    assert b in probed and len(probed) <= 5
    assert own.predicted_overhead == pytest.approx(max(0.0, (1 + first.predicted_overhead) * ratio - 1))
    above = [x for x in budgets() if x > b]
    if above:  # bisection measured a larger budget too, which did not fit
        assert compiled_peak(model, batch, {}, compiler("aot_eager", above[0])) > budget

    v = memfit.validate(model, batch, own, steps=0)
    assert v.ok and v.grads_equal and v.compile_memory_budget == b
    assert v.measured_peak_bytes == own.compile["peak_bytes"] < v.plain_peak_bytes
    path = tmp_path / "schedule.json"
    own.save(path)
    loaded = load_schedule(path)
    assert loaded.compile == own.compile
    backend = memfit.compile_backend(loaded)
    assert backend is compiler("aot_eager", b)  # one object per budget: Dynamo guards on it
    torch.compiler.reset()
    assert compiled_peak(model, batch, {}, backend) == own.compile["peak_bytes"]
    with pytest.raises(memfit.MemfitError, match="eager step"):
        memfit.compile_backend(dataclasses.replace(first, compile=None))


def test_the_compilers_own_plan_is_left_out_where_it_recomputes_a_dropout():
    """With dropout, the partitioner under a budget that fits recomputes a dropout with a fresh
    mask (PyTorch issue #190758): the loss is the plain one, the gradients are not. Such a plan
    is measured, found out and left out."""
    model, batch = _gpt(0.1)
    harness = StepHarness(model, batch)
    with harness.restoring() as found:
        plain = harness.run(compile="aot_eager")
        found.restore()
        torch.compiler.reset()
        low = harness.run(compile=compiler("aot_eager", 0.5))
    assert not agreement(plain, low, None)["grads_equal"]  # the partitioner's doing, not memfit's
    torch.compiler.reset()
    first, prof = _first_plan(model, batch, low.peak_bytes)
    said: list[str] = []
    with CompiledSteps(model, batch, "aot_eager", versions=12) as compiled:
        assert _compilers_own(compiled, first, prof.step_s, model, "aot_eager", said.append) is None
    assert "gradients are not the plain step's" in said[-1] and "left out" in said[-1], said


def test_a_users_loop_under_the_compilers_own_plan_trains_as_the_plain_compiled_model():
    """The user's side, in a loop written as users write it: ``apply`` the schedule, compile with
    ``memfit.compile_backend(schedule)``, train three AdamW steps; every parameter ends bit for bit
    where the plain compiled model's does, and the step under the budget peaks lower."""
    model, batch = _gpt(0.0)
    first, _ = _first_plan(model, batch, budget=1)
    schedule = dataclasses.replace(first, policies=dict.fromkeys(first.policies, KEEP),
                                   compile={"backend": "aot_eager", "peak_bytes": 1, "memory_budget": 0.5})

    def train(m, backend):
        run = torch.compile(m, backend=backend)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            run(**batch)["loss"].backward()
            opt.step()
        return m

    plain = train(copy.deepcopy(model), "aot_eager")
    torch.compiler.reset()
    ours = train(memfit.apply(copy.deepcopy(model), schedule), memfit.compile_backend(schedule))
    for (name, a), b in zip(plain.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), name
    torch.compiler.reset()
    under = compiled_peak(model, batch, {}, memfit.compile_backend(schedule))
    assert under < compiled_peak(model, batch, {}, "aot_eager")
