"""memfit.remove undoes apply completely; a scheduled model warns once per new input signature."""

import dataclasses
import warnings

import pytest
import torch

import memfit
import memfit.formats.schedule
from memfit.policy import FULL, KEEP, Segment

from .conftest import tiny_gpt


@pytest.fixture(scope="module")
def planned():
    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1)
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    return prof, memfit.plan(prof, (2 * lo + hi) // 3)


def _grads(model, batch):
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    memfit.default_loss(model(**batch)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _state(model):
    return {name: (type(m), sorted(k for k in m.__dict__ if "memfit" in k), len(m._forward_pre_hooks),
                   len(m._forward_hooks)) for name, m in model.named_modules()}


def test_remove_restores_the_model_and_apply_works_again(planned):
    segment = Segment("h.1", "h.2")  # a full unit and a segment, both undone
    sched = dataclasses.replace(planned[1], policies={"h.0": FULL, "h.1": segment, "h.2": segment, "h.3": KEEP})
    model, batch = tiny_gpt()
    before, plain = _state(model), _grads(model, batch)
    memfit.apply(model, sched)
    assert _state(model) != before
    with pytest.raises(memfit.MemfitError, match=r"memfit\.remove"):
        memfit.apply(model, sched)
    assert memfit.remove(model) is model
    assert _state(model) == before  # classes, attributes and hooks as they were
    assert all(torch.equal(g, plain[n]) for n, g in _grads(model, batch).items())
    memfit.apply(model, sched)  # again, after remove
    assert all(torch.equal(g, plain[n]) for n, g in _grads(model, batch).items())
    memfit.remove(model)


def test_drift_warning_once_per_new_larger_input_signature(planned):
    _, sched = planned
    model, batch = tiny_gpt()
    memfit.apply(model, sched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**batch)  # the planned inputs: silent
        model(**{k: v[:, :16] for k, v in batch.items()})  # shorter fits the plan: silent
        assert not caught
        big = {k: torch.cat([v, v]) for k, v in batch.items()}
        model(**big)
        model(**big)  # the same new shape again: no second warning
        assert [type(w.message) for w in caught] == [memfit.PlanDriftWarning]
        text = str(caught[0].message)
        assert sched.input_shapes in text and "idx int64[8,32] (planned int64[4,32])" in text
        assert "memfit.plan(memfit.profile(model" in text and "memfit.zoo.GPT" in text  # planned from Python
        model(**{k: torch.cat([v, v, v]) for k, v in batch.items()})  # another larger shape: one more
        assert len(caught) == 2
    memfit.remove(model)
    # planned from the command line: the warning ends in the command that plans again
    for source, tail in (({"scenario": "gpt-small"}, "and plan again: memfit plan --scenario gpt-small --budget "),
                         ({"model": "m.py:f", "input_shape": [4, 32]},
                          "plan again for them: memfit plan --model m.py:f --input-shape 8x32 --budget ")):
        sched.source = source
        memfit.apply(model, sched)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(big["idx"])
        text = str(caught[0].message)
        assert tail in text and text.rstrip().endswith("MiB"), text
        memfit.remove(model)
    memfit.remove(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**big)  # removed: no watching
        assert not caught


def test_fallbacks_are_ever_tighter_and_round_trip(planned, tmp_path):
    prof, _ = planned
    hi = memfit.predict(prof, {}).peak_bytes
    sched = memfit.plan(prof, hi, fallbacks=3)
    peaks = [sched.predicted_peak_bytes, *(f["predicted_peak_bytes"] for f in sched.fallbacks)]
    assert len(sched.fallbacks) == 3 and peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    assert peaks[-1] == memfit.min_budget_bytes(prof)
    for f in sched.fallbacks:
        assert memfit.predict(prof, f["policies"]).peak_bytes == f["predicted_peak_bytes"] <= f["budget_bytes"]
    sched.save(tmp_path / "s.json")
    sched.solve_s = None
    assert memfit.load_schedule(tmp_path / "s.json") == sched


def test_tighten_walks_the_ladder_and_each_plan_fits(planned):
    """Each rung's measured peak is its predicted one (the CPU meter is exact), and an injected
    out-of-memory error in a training loop is survived by stepping down."""
    from memfit.runtime.harness import measure_steps

    prof, _ = planned
    sched = memfit.plan(prof, memfit.predict(prof, {}).peak_bytes, fallbacks=2)
    model, batch = tiny_gpt()
    memfit.apply(model, sched)
    measured = [measure_steps(model, batch).peak_bytes]
    while memfit.tighten(model):
        measured.append(measure_steps(model, batch).peak_bytes)
    assert measured == [sched.predicted_peak_bytes, *(f["predicted_peak_bytes"] for f in sched.fallbacks)]
    assert not memfit.tighten(model)
    memfit.remove(model)

    memfit.apply(model, sched)
    rung = {"level": 0}

    def out_of_memory_until_tightened(module, args, kwargs):
        if rung["level"] == 0:
            raise torch.OutOfMemoryError("injected: the plan did not fit")

    hook = model.register_forward_pre_hook(out_of_memory_until_tightened, with_kwargs=True)
    losses = []
    for _ in range(2):
        while True:
            try:
                loss = memfit.default_loss(model(**batch))
                break
            except torch.OutOfMemoryError:
                assert memfit.tighten(model)
                rung["level"] += 1
        loss.backward()
        losses.append(loss.item())
    assert rung["level"] == 1 and len(losses) == 2
    hook.remove()
    memfit.remove(model)


class _ListNet(torch.nn.Module):
    """Inputs in a list and a dict, as collators hand them over, and an extra scalar keyword."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                          for _ in range(3))

    def forward(self, parts, extra=None, num_items_in_batch=None):
        h = torch.cat(parts, dim=0) + (0 if extra is None else extra["bias"])
        for block in self.blocks:
            h = block(h)
        return h


def test_drift_compares_nested_tensors_and_ignores_scalars_and_no_grad():
    from memfit.runtime.watch import larger, signature

    model = _ListNet()
    inputs = ([torch.randn(4, 8), torch.randn(4, 8)], {"bias": torch.zeros(8)})
    prof = memfit.profile(model, inputs, units="blocks.*", repeat=1)
    assert prof.input_shapes == "0.0=float32[4,8], 0.1=float32[4,8], 1.bias=float32[8]"
    sched = memfit.plan(prof, memfit.predict(prof, {}).peak_bytes)
    memfit.apply(model, sched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(*inputs, num_items_in_batch=17)  # a scalar the Trainer adds: not memory
        model([torch.randn(2, 8)], extra=inputs[1])  # fewer, smaller: fits
        with torch.no_grad():
            model([torch.randn(32, 8), torch.randn(32, 8)], inputs[1])  # evaluation keeps no activations
        assert not caught
        model([torch.randn(32, 8), torch.randn(32, 8)], inputs[1])  # 8x the batch, inside a list
        assert len(caught) == 1 and "parts.0 float32[32,8] (planned float32[4,8])" in str(caught[0].message)
    assert larger(signature("x=bfloat16[4]"), signature("x=float32[4]")) == []
    assert larger(signature("x=float64[4]"), signature("x=float32[4]")) == ["x float64[4] (planned float32[4])"]
    assert larger(signature("float32[4], y=int64[2]"), signature("float32[4]")) == ["y (not in the plan)"]


def test_a_model_with_the_same_parameters_but_other_heads_is_refused():
    """GPT-2 with 16 heads instead of 2 has the same parameter shapes and other activations."""
    transformers = pytest.importorskip("transformers")
    models = [transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=h, vocab_size=128,
                                                                   n_positions=32)) for h in (2, 16)]
    names = ["transformer.h.0", "transformer.h.1"]
    fingerprints = [memfit.formats.schedule.model_fingerprint(m, names) for m in models]
    assert fingerprints[0]["params_sha256"] == fingerprints[1]["params_sha256"]
    sched = memfit.Schedule(dict.fromkeys(names, FULL), 1, 0, 0.0, 0.0, "test", "none", "none", 0.0,
                            fingerprints[0])
    with pytest.raises(memfit.ScheduleMismatchError, match="other settings inside the units, such as attention heads"):
        memfit.apply(models[1], sched)
    memfit.apply(models[0], sched)


def test_drift_warning_names_the_scenario_to_plan_again(planned):
    sched = dataclasses.replace(planned[1], source={"scenario": "gpt-small"})
    model, batch = tiny_gpt()
    memfit.apply(model, sched)
    with pytest.warns(memfit.PlanDriftWarning, match="memfit plan --scenario gpt-small --budget"):
        model(**{k: torch.cat([v, v]) for k, v in batch.items()})
