"""Budgets against what a GPU can hold: the device table, usable memory (total less the CUDA
context, less the allocator's margin), device spec files, and the cap every plan keeps to."""

import dataclasses
import json
from pathlib import Path

import pytest

import memfit
from memfit.devices import (
    CONTEXT_BYTES,
    DEVICES,
    MARGIN,
    MiB,
    describe_memory,
    device_spec,
    load_device_spec,
    spec_toml,
    usable_bytes,
)
from memfit.planning.peak import allocator_ratio, device_cap_bytes, fsdp_headroom
from memfit.policy import FULL, KEEP
from memfit.profiler.estimate import estimate
from memfit.report import device_notes

from .conftest import TINY, run_cli, tiny_gpt

FIXTURES = Path(__file__).parent / "fixtures"
ASKED = ("v100-16gb", "v100-32gb", "a10", "t4", "l4", "l40s", "a6000", "a100-40gb", "a100-80gb", "h100", "h100-pcie",
         "h200", "b200", "mi250x", "mi300x")


def run(*args, cwd):
    proc = run_cli(*args, cwd=cwd)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _with_memory(total: int, profile: str = "gpt-small.json") -> memfit.Profile:
    prof = memfit.Profile.load(FIXTURES / profile)
    prof.memory = {"title": "Test GPU", "total_bytes": total, "context_bytes": 8 * MiB, "margin": 0.1,
                   "source": "a test"}
    return prof


def test_every_device_has_its_figures_and_a_source():
    assert set(ASKED) <= set(DEVICES)
    for d in DEVICES.values():
        assert d.source and (not d.cuda or "." in d.source), d.name  # a place to read it, not just a name
        assert d.memory_bytes % MiB == 0 and d.tflops["float32"] > 0 and d.bandwidth_gbs > 0
        if d.cuda:  # (total - context) / (1 + margin), in whole bytes
            assert d.usable_bytes == int((d.memory_bytes - d.context_bytes) / (1 + d.margin))
            assert d.margin == MARGIN and (d.context_bytes == CONTEXT_BYTES or "measured" in d.source), d.name
            assert d.memory is not None and usable_bytes(d.memory) == d.usable_bytes
    # what PyTorch reports, not the marketed size: an H100 80GB has 79.19 GiB, an H200 139.80 GiB
    assert DEVICES["h100"].memory_bytes == 81089 * MiB and DEVICES["h200"].memory_bytes == 143156 * MiB
    assert describe_memory(DEVICES["rtx4090"].memory).startswith("20.67 GiB usable on NVIDIA GeForce RTX 4090 "
                                                                 "(23.65 GiB total, less 512.00 MiB")


def test_a_device_spec_file_starts_from_a_builtin_and_round_trips(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "a100-80gb"\nmemory = "79.25GiB"\ncontext = "600MiB"\nmargin = 0.07\n')
    mine = load_device_spec(path)
    a100 = device_spec("a100-80gb")
    assert (mine.name, mine.tflops, mine.bandwidth_gbs) == ("mine", a100.tflops, a100.bandwidth_gbs)
    assert mine.memory_bytes == round(79.25 * 2**30) and mine.context_bytes == 600 * MiB and mine.margin == 0.07
    assert mine.usable_bytes == int((mine.memory_bytes - 600 * MiB) / 1.07)
    text = spec_toml(name="learned", title=a100.title, base=a100.name, total=mine.memory_bytes, context=123 * MiB,
                     margin=0.0815, source='memfit validate "s.json"', over_model=0.031)
    (tmp_path / "learned.toml").write_text(text)
    learned = load_device_spec(tmp_path / "learned.toml")
    assert (learned.memory_bytes, learned.context_bytes, learned.margin) == (mine.memory_bytes, 123 * MiB, 0.0815)
    assert learned.source == 'memfit validate "s.json"' and learned.title == a100.title
    assert learned.over_model == 0.031 and learned.memory["over_model"] == 0.031
    assert "over_model" not in mine.memory and mine.over_model == 0.0  # none learned: the model as it is


@pytest.mark.parametrize("text, words", [
    ('memory = "8GB"\n', "give base"),
    ('base = "h100"\nmargin = 1.5\n', "margin is reserved/allocated"),
    ('base = "h100"\nover_model = -0.1\n', "over_model is the card's reserved over the allocator model's"),
    ('base = "h100"\ncolour = "red"\n', "unknown field"),
    ('base = "tpu"\n', "unknown target 'tpu'"),
    ('base = "h100"\nmemory = "lots"\n', "field 'memory'"),
    ('base = "h100"\ncontext = "90GB"\n', "not less than the memory"),
    ('base = "h100"\ntflops = { bfloat16 = 1 }\n', "tflops must be a table"),
])
def test_device_spec_mistakes_are_named(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(memfit.MemfitError, match=words):
        load_device_spec(path)


def test_a_budget_over_the_usable_memory_is_planned_for_the_usable_memory(tmp_path):
    prof = _with_memory(300 * MiB)
    cap = device_cap_bytes(prof)
    assert cap == int((300 * MiB - 8 * MiB) / 1.1)
    unplanned = memfit.predict(prof, {}).peak_bytes
    assert unplanned > cap  # so the cap decides the plan
    sched = memfit.plan(prof, "2GB")
    assert sched.budget_bytes == cap and sched.asked_budget_bytes == 2 * 2**30
    assert sched.checkpointed and sched.predicted_peak_bytes <= cap
    assert sched.predicted_peak_bytes == memfit.plan(prof, cap).predicted_peak_bytes
    sched.save(tmp_path / "s.json")
    loaded = memfit.load_schedule(tmp_path / "s.json")
    assert loaded.memory == prof.memory and loaded.asked_budget_bytes == 2 * 2**30
    below = memfit.plan(prof, cap - 1)  # a budget under the cap is the user's, as ever
    assert below.budget_bytes == cap - 1 and below.asked_budget_bytes is None
    with pytest.raises(memfit.InfeasibleBudgetError, match="more than the device leaves"):
        memfit.plan(_with_memory(100 * MiB), "2GB")


def test_fsdp_headroom_comes_off_the_cap():
    prof = _with_memory(300 * MiB)
    prof.parallel = {"kind": "fsdp", "world_size": 2}
    headroom = fsdp_headroom(prof)
    assert headroom == 2 * max(u.param_bytes for u in prof.units) > 0
    assert device_cap_bytes(prof) == int((300 * MiB - 8 * MiB) / 1.1) - headroom
    assert memfit.plan(prof, "2GB").predicted_peak_bytes <= device_cap_bytes(prof)


def test_where_the_allocators_model_keeps_more_than_the_margin_the_plan_leaves_it_free(tmp_path):
    """Estimate mode's model of the caching allocator (Profile.reserved_peak_bytes) sets a plan's
    cap where it has the plan reserve more over its allocated peak than the device's margin
    (FSDP2's Llama with every layer checkpointed: 30%), and never raises it."""
    prof = _with_memory(300 * MiB)  # 8 MiB of context, a 10% margin
    fixed = device_cap_bytes(prof)
    alone = memfit.plan(prof, "2GB")  # the fixed margin's plan
    kept, full = prof.measured_peak_bytes[KEEP], prof.measured_peak_bytes[FULL]
    prof.reserved_peak_bytes = {KEEP: round(kept * 1.05), FULL: round(full * 1.40)}
    n = len(prof.units)
    assert device_cap_bytes(prof, {}) == fixed  # 5% over: the margin stands
    ratio = allocator_ratio(prof, alone.policies)
    assert ratio == pytest.approx(1.05 + 0.35 * sum(p != KEEP for p in alone.policies.values()) / n)
    assert alone.predicted_peak_bytes > device_cap_bytes(prof, alone.policies)  # that plan would not fit
    sched = memfit.plan(prof, "2GB")
    ratio = allocator_ratio(prof, sched.policies)
    assert ratio > 1.1 and sched.predicted_peak_bytes <= (300 * MiB - 8 * MiB) / ratio
    assert sched.budget_bytes < fixed and sched.asked_budget_bytes == 2 * 2**30
    assert sched.predicted_overhead > alone.predicted_overhead
    notes = device_notes(sched, prof)
    assert any(f"reserve {ratio - 1:.1%} over its allocated peak, more than the 10% margin" in n for n in notes)
    assert not any(n.startswith("warning") for n in notes)
    assert any(n.startswith("warning") for n in device_notes(alone, prof))
    assert sched.reserved_ratio == ratio and alone.reserved_ratio is None  # what validate learns the card's over
    sched.save(tmp_path / "s.json")
    assert memfit.load_schedule(tmp_path / "s.json").reserved_ratio == ratio
    assert "reserved_ratio" not in alone.to_dict()
    prof.memory["over_model"] = 0.25  # a card that reserved 25% over the model: every cap with the model lower
    assert device_cap_bytes(prof, sched.policies) == int((300 * MiB - 8 * MiB) / (ratio * 1.25))
    assert device_cap_bytes(prof, {}) == int((300 * MiB - 8 * MiB) / (1.05 * 1.25))
    kept_plan = dataclasses.replace(sched, policies={})  # 5% by the model alone, under the margin: the card's
    assert any(f"reserve {1.05 * 1.25 - 1:.1%} over its allocated peak (with the card's learned over_model)" in n
               for n in device_notes(kept_plan, prof))
    del prof.memory["over_model"]
    prof.reserved_peak_bytes = {KEEP: round(kept * 1.01), FULL: round(full * 1.02)}  # under: as before
    assert memfit.plan(prof, "2GB").policies == alone.policies


def test_files_without_a_memory_record_plan_as_they_did():
    prof = memfit.Profile.load(FIXTURES / "gpt-small.json")
    assert prof.memory is None and device_cap_bytes(prof) is None
    assert "memory" not in prof.to_dict()
    assert memfit.plan(prof, "2GB").budget_bytes == 2 * 2**30


def test_an_estimate_records_its_targets_memory_and_a_spec_file_can_be_the_target(tmp_path):
    t4 = estimate(tiny_gpt, target="t4")
    assert t4.memory == DEVICES["t4"].memory
    path = tmp_path / "small.toml"
    path.write_text('base = "t4"\ntitle = "Small card"\nmemory = "64MiB"\ncontext = "8MiB"\nmargin = 0.1\n')
    small = estimate(tiny_gpt, target=load_device_spec(path))
    assert small.target == "small" and small.memory["title"] == "Small card"
    assert small.memory["total_bytes"] == 64 * MiB and small.units[0].options == t4.units[0].options
    model, batch = tiny_gpt()  # applied on the CPU, a plan for a card of one's own says so by its title
    memfit.apply(model, memfit.plan(small, memfit.predict(small, {}).peak_bytes))
    with pytest.warns(memfit.PlanDriftWarning, match=r"estimated for Small card \(small\).*the CPU"):
        model(**batch)


def test_the_cli_prints_usable_memory_in_every_branch(tmp_path):
    """plan (capped, and fitting without checkpointing), sweep and scenarios say what the device
    leaves; --device-spec estimates for a card of one's own."""
    (tmp_path / "tiny.toml").write_text(TINY)
    proc = run("plan", "--scenario", "tiny.toml", "--target", "t4", "--budget", "100GB", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "fits without checkpointing" in proc.stdout
    assert "device memory: 12.73 GiB usable on Tesla T4 (14.75 GiB total" in proc.stdout
    assert "note: the budget asked for, 100.00 GiB, is more than that" in proc.stdout
    (tmp_path / "small.toml").write_text('base = "t4"\ntitle = "Small card"\nmemory = "64MiB"\ncontext = "8MiB"\n'
                                         'margin = 0.1\n')
    proc = run("plan", "--scenario", "tiny.toml", "--device-spec", "small.toml", "--budget", "100GB", "--json",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["budget_bytes"] == int(56 * MiB / 1.1) and data["asked_budget_bytes"] == 100 * 2**30
    assert data["target"] == "small" and data["memory"]["title"] == "Small card"
    proc = run("sweep", "--scenario", "tiny.toml", "--target", "t4", "--points", "3", "--strategies", "full",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "device memory: 12.73 GiB usable on Tesla T4" in proc.stdout
    proc = run("scenarios", cwd=tmp_path)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "20.67 GiB" in rows["gpt-750m"] and "adamw, amp-bf16" in rows["gpt-750m"]
    assert "70.26 GiB" in rows["llama3-8b-fsdp"] and "usable:" in proc.stdout
    proc = run("plan", "--scenario", "tiny.toml", "--device-spec", "small.toml", "--target", "t4", "--budget", "1GB",
               cwd=tmp_path)
    assert proc.returncode == 2 and "either --target NAME or --device-spec FILE" in proc.stderr


def test_a_scenario_names_a_spec_file_and_a_parallel_layout(tmp_path):
    (tmp_path / "card.toml").write_text('base = "l4"\nmargin = 0.2\n')
    (tmp_path / "s.toml").write_text(TINY.replace('model = "memfit.zoo:gpt"',
                                                  'model = "memfit.zoo:gpt"\ntarget = "card.toml"\n'
                                                  'parallel = "fsdp"\nworld_size = 4'))
    from memfit.scenarios import load_scenario

    sc = load_scenario(str(tmp_path / "s.toml"))
    assert sc.target_device().margin == 0.2 and (sc.parallel, sc.world_size) == ("fsdp", 4)
    (tmp_path / "bad.toml").write_text(TINY.replace('model = "memfit.zoo:gpt"', 'model = "memfit.zoo:gpt"\n'
                                                    'world_size = 4'))
    with pytest.raises(memfit.MemfitError, match="give parallel too"):
        load_scenario(str(tmp_path / "bad.toml"))


def test_validation_reports_the_cards_reserved_peak_context_and_margin():
    from memfit.report import validation_report
    from memfit.steps.validate import Validation

    gib = 2**30
    v = Validation(budget_bytes=20 * gib, predicted_peak_bytes=19 * gib, measured_peak_bytes=19 * gib,
                   plain_peak_bytes=30 * gib, predicted_overhead=0.1, measured_overhead=0.1, plain_step_s=1.0,
                   step_s=1.1, max_grad_diff=0.0, losses_equal=True, grads_equal=True, buffers_equal=True,
                   cuda={"total_bytes": 24 * gib, "free_bytes": 2 * gib, "reserved_bytes": 21 * gib,
                         "reserved_peak_bytes": 21 * gib})
    assert v.context_bytes == gib and v.margin == pytest.approx(2 / 19) and v.reserved_fits and v.ok
    text = validation_report(v)
    assert "reserved peak 21.00 GiB (+10.5% over the allocated peak" in text
    assert "1.00 GiB outside the allocator" in text
    assert v.over_model is None and "allocator's model" not in text  # a plan not made in estimate mode
    v.reserved_ratio = 1.05  # the estimate's allocator model had this plan reserve 5% over its allocated peak
    assert v.over_model == pytest.approx(21 / (19 * 1.05) - 1)
    assert "predicted +5.0% over the allocated peak: the card reserved +5.3% over that" in validation_report(v)
    v.cuda = {**v.cuda, "reserved_peak_bytes": 23 * gib + 1}
    assert not v.reserved_fits and not v.ok and "EXCEED the card's memory" in validation_report(v)
