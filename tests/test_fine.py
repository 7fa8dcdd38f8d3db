"""Finer than a block: child-module and op-level options, measured, predicted and applied."""

import copy
import random

import pytest
import torch

import memfit
from memfit.measure.inputs import Inputs
from memfit.measure.step import default_loss
from memfit.policy import FULL, KEEP, Derive, Nested, Selective, as_policies, parse
from memfit.profiler.options import fine_options
from memfit.profiler.saved import unit_facts
from memfit.runtime.apply import clear_policies, set_policies
from memfit.runtime.harness import measure_steps

from .conftest import tiny_gpt
from .test_apply import _assert_identical, _run, _schedule
from .test_fidelity import cnn_mixed, hf_gpt2, hf_llama


def nano():
    """nanoGPT with its attention written out, dropout on: the model memfit was not built around."""
    from memfit import zoo

    return zoo.nanogpt(batch=2, seq=32, vocab=256, d_model=64, n_head=2, n_layer=3, dropout=0.1)


FACTORIES = {"gpt": tiny_gpt, "hf-gpt2": hf_gpt2, "hf-llama": hf_llama, "cnn": cnn_mixed, "nano": nano}
TOLERANCE = 0.01
# The BatchNorm CNN's whole-unit regions (full, selective) are predicted 32 KiB (1.6%) high, as
# full always was there (test_fidelity allows 3%): the memory model books a shared block output
# cautiously. Child options and the transformers are predicted exactly. A random mix (children,
# nested, full: which options a mix draws from depends on the profile's times, as pruning does)
# once came out 64 KiB (3.5%, one block's activation) high in CI, never low: the cautious booking
# twice in one step.
CAUTION = {"cnn": 0.04}


def _fine(name):
    model, inputs = FACTORIES[name]()
    units = "blocks.*" if name == "cnn" else "auto"
    optimizer = "sgd-momentum" if name == "cnn" else "adamw"
    prof = memfit.profile(model, inputs, units=units, optimizer=optimizer, repeat=1, granularity="fine")
    return model, inputs, prof, optimizer


@pytest.fixture(scope="module", params=list(FACTORIES))
def fine(request):
    return request.param, *_fine(request.param)


def test_children_and_policies_are_found_and_measured(fine):
    name, model, inputs, prof, _ = fine
    options = {o for u in prof.units for o in u.options} - {KEEP, FULL}
    # the CNN's blocks: every child keeps more than it frees or frees nothing; keeping every conv
    # output, as BatchNorm needs it anyway, costs more than keeping nothing: all dominated, dropped
    # the transformers with a norm or an activation feeding one product: the chains, alone and
    # along with each child (its own norm in front); Llama's norms feed three products, its
    # activation a product with another branch: no chain there
    # derive on the transformers (norm and activation outputs, dropped attention probabilities);
    # the CNN's ReLUs keep their own outputs: nothing to re-derive
    # nested: the whole unit, with the child options' regions that do not overlap inside it
    expected = {"gpt": {"child:ln_1>attn.qkv+ln_2>mlp.0+mlp.1>mlp.2", "child:ln_1>attn+ln_2>mlp.0+mlp.1>mlp.2",
                        "child:ln_2>mlp+ln_1>attn.qkv", "derive", "nested:ln_1>attn+ln_2>mlp.0+mlp.1>mlp.2"},
                "hf-gpt2": {"child:ln_1>attn.c_attn+ln_2>mlp.c_fc+mlp.act>mlp.c_proj",
                            "child:ln_1>attn+ln_2>mlp.c_fc+mlp.act>mlp.c_proj", "child:ln_2>mlp+ln_1>attn.c_attn",
                            "derive", "nested:ln_1>attn+ln_2>mlp.c_fc+mlp.act>mlp.c_proj"},
                "hf-llama": {"child:self_attn", "child:mlp", "derive", "nested:self_attn+mlp+input_layernorm"},
                "cnn": set(),
                # written-out attention: its core (q.k^T, mask, softmax) re-derived, the linears kept
                "nano": {"derive:products@attn", "derive",
                         "nested:ln_1>attn+ln_2>mlp.c_fc+mlp.gelu>mlp.c_proj"}}[name]
    # what is offered is fixed by the model; what survives pruning depends on measured times (an
    # option is dropped where another keeps no more and ran no slower), so check the offer
    facts = unit_facts(model, prof.unit_names, Inputs.of(inputs), default_loss)
    offers = fine_options(model, prof.unit_names, Inputs.of(inputs), default_loss, facts.saved)
    offered = {o for opts in offers.values() for o in opts}
    assert {parse(e) for e in expected} <= offered and options <= offered and prof.fine == bool(options)
    if name != "cnn":  # derive inside a child, where the gemm op set was offered before (at SAC's cost)
        assert any(isinstance(o, Derive) and o.child for o in offered)
        assert not any(isinstance(o, Selective) and o.ops == "gemm" and o.child for o in offered)
    # the op sets (SAC's dispatch mode over every op) only where derive:products is not offered on
    # that module: it keeps the products and re-runs the rest, dropout's draws included
    for unit in offers.values():
        deep = {o.child for o in unit if isinstance(o, Derive) and o.level >= 1}
        assert not any(isinstance(o, Selective) and o.child in deep for o in unit)
    for option in options:
        has = [u.name for u in prof.units if option in u.options]
        if len(has) < len(prof.units):
            continue  # dropped where dominated: the step that measured it differs from this plan
        # every unit that has it ran it in one step: the walk of that step is what was measured
        # (up to the remainder phases, which the walk takes as the larger of the none and full steps')
        predicted = memfit.predict(prof, dict.fromkeys(has, option)).peak_bytes
        measured = prof.measured_peak_bytes[option]
        assert 0 <= predicted - measured <= CAUTION.get(name, 0.001) * measured


def test_mixed_fine_plans_predicted_within_one_percent(fine):
    name, model, inputs, prof, optimizer = fine
    rng = random.Random(0)
    for _ in range(3):
        policies = {u.name: rng.choice(list(u.options)) for u in prof.units}
        twin = copy.deepcopy(model)
        set_policies(twin, policies)
        measured = measure_steps(twin, inputs, optimizer=optimizer).peak_bytes
        predicted = memfit.predict(prof, policies).peak_bytes
        assert abs(predicted - measured) / measured <= CAUTION.get(name, TOLERANCE), (policies, predicted, measured)
        assert predicted >= measured


def test_fine_plan_fits_and_is_never_dearer_than_module_plan(fine):
    _, model, inputs, prof, optimizer = fine
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    for frac in (0.3, 0.7):
        budget = int(lo + frac * (hi - lo))
        coarse = memfit.plan(prof, budget)
        sched = memfit.plan(prof, budget, granularity="fine")
        assert sched.predicted_recompute_s <= coarse.predicted_recompute_s + 1e-12
        measured = measure_steps(memfit.apply(copy.deepcopy(model), sched), inputs, optimizer=optimizer).peak_bytes
        assert measured <= budget


@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_fine_option_gives_the_plain_models_results(name):
    """Loss, outputs, gradients, weights and buffers (BatchNorm statistics), dropout included,
    with every unit under each finer option and under a mix of them."""
    model, inputs = FACTORIES[name]()
    units = memfit.units.find_units(model, "blocks.*" if name == "cnn" else "auto")
    unit = model.get_submodule(units[0])
    children = [c for c, m in unit.named_children() if any(True for _ in m.parameters())]
    options = [parse(o) for o in [f"child:{c}" for c in children] + [
        "selective:gemm", f"child:{'+'.join(children[:2])}", f"selective:gemm@{children[-1]}", "derive"]]
    facts = unit_facts(model, units, Inputs.of(inputs), default_loss)
    options += fine_options(model, units, Inputs.of(inputs), default_loss, facts.saved)[units[0]]  # chains
    mixes = [dict.fromkeys(units, o) for o in options]
    mixes.append({u: options[k % len(options)] for k, u in enumerate(units)})
    pristine = copy.deepcopy(model)
    expected = _run(model, inputs)
    for policies in mixes:
        twin = copy.deepcopy(pristine)
        memfit.apply(twin, _schedule(pristine, policies))
        _assert_identical(expected, _run(twin, inputs))


def test_fine_schedule_round_trips_and_is_refused_when_wrong(tmp_path):
    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1, granularity="fine")
    lo, hi = memfit.min_budget_bytes(prof, fine=True), memfit.predict(prof, {}).peak_bytes
    sched = memfit.plan(prof, (lo + hi) // 2, granularity="fine", fallbacks=2)
    sched.save(tmp_path / "s.json")
    loaded = memfit.load_schedule(tmp_path / "s.json")
    assert loaded.policies == sched.policies and loaded.fallbacks == sched.fallbacks
    with pytest.raises(memfit.ScheduleMismatchError, match=r"h\.0\.nothing"):
        memfit.apply(copy.deepcopy(model), _schedule(model, {"h.0": parse("child:nothing")}))
    with pytest.raises(memfit.MemfitError, match="selective:magic"):
        memfit.apply(copy.deepcopy(model), _schedule(model, {"h.0": parse("selective:magic")}))
    with pytest.raises(memfit.MemfitError, match="measured options"):
        memfit.predict(prof, {"h.0": parse("child:ln_1")})


def compiled_steps(policies):
    """The tiny GPT's steady-state step compiled (aot_eager), plain and under ``policies``."""
    model, batch = tiny_gpt()
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    torch._dynamo.reset()
    try:
        return (measure_steps(model, batch, optimizer=None, compile="aot_eager"),
                measure_steps(twin, batch, optimizer=None, compile="aot_eager"))
    finally:
        torch._dynamo.reset()


def test_fine_options_under_compile():
    plain, sched = compiled_steps(as_policies({"h.0": "child:attn", "h.1": "selective:gemm@mlp",
                                               "h.2": "selective:gemm", "h.3": "child:ln_2>mlp+ln_1>attn.qkv"}))
    assert sched.peak_bytes < plain.peak_bytes
    assert all(torch.equal(g, plain.grads[n]) for n, g in sched.grads.items())
    # nested regions become nested checkpoints in the graph, which the partitioner flattens: the
    # gradients are right and the peak is full's (what a compiled profile measures and prices)
    nested = parse("nested:ln_1>attn+ln_2>mlp.0+mlp.1>mlp.2")
    _, both = compiled_steps({"h.0": nested, "h.1": FULL, "h.2": nested, "h.3": KEEP})
    _, fulls = compiled_steps({"h.0": FULL, "h.1": FULL, "h.2": FULL, "h.3": KEEP})
    assert both.peak_bytes == fulls.peak_bytes
    assert all(torch.equal(g, plain.grads[n]) for n, g in both.grads.items())


def test_a_chain_recomputes_only_its_producer():
    """Early stop: the product at the chain's end saves its input before it computes, so the
    backward recomputes the norm or activation and no matrix product (FLOPs as plain), and the
    producer's output is not kept (peak lower)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, batch = tiny_gpt()
    units = [f"h.{k}" for k in range(4)]

    def step(policy: str) -> tuple[int, int]:
        twin = copy.deepcopy(model)
        set_policies(twin, dict.fromkeys(units, parse(policy)) if policy else {})
        with FlopCounterMode(display=False) as counter:
            twin(**batch)["loss"].backward()
        return counter.get_total_flops(), measure_steps(twin, batch).peak_bytes

    plain, chains, mlp = step(""), step("child:ln_1>attn.qkv+ln_2>mlp.0+mlp.1>mlp.2"), step("child:mlp")
    assert chains[0] == plain[0] < mlp[0]
    assert chains[1] < plain[1]


def test_regions_keep_nothing_of_a_step_for_the_next():
    """A Hugging Face attention takes masks and position tensors as keywords; the region must not
    hold them past the step, or their free lands inside the next (measured) step and the
    prediction comes out a few hundred bytes low."""
    model, inputs = hf_gpt2()
    names = memfit.units.find_units(model, "auto")
    set_policies(model, dict.fromkeys(names, parse("child:ln_1>attn+ln_2>mlp.c_fc")))
    model(**inputs).loss.backward()
    regions = {id(r): r for m in model.modules() if (r := m.__dict__.get("_memfit_region")) is not None}
    assert len(regions) == 2 * len(names)
    assert not any(r.is_open for r in regions.values())  # the open state holds the calls and the last output


def test_a_chain_refuses_a_forward_that_does_not_feed_it():
    model, batch = tiny_gpt()
    set_policies(model, {"h.0": parse("child:mlp.0>mlp.2")})  # mlp.2 takes the GELU's output, not mlp.0's
    with pytest.raises(memfit.MemfitError, match="called with the output of Linear"):
        model(**batch)
    clear_policies(model)  # the failed region left no saved-tensor context open: plain results follow
    torch.manual_seed(0)
    model(**batch)["loss"].backward()
    fresh, _ = tiny_gpt()
    torch.manual_seed(0)
    fresh(**batch)["loss"].backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))


def test_named_children_replace_the_automatic_choice():
    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1, granularity="fine", children=["mlp.0", "attn+mlp"])
    assert set(map(str, prof.units[0].options)) <= {"none", "full", "child:mlp.0", "child:attn+mlp",
                                                    "selective:gemm@mlp.0", "derive", "derive:products",
                                                    "derive:projections",
                                                    "derive:all", "nested:attn+mlp"}
    assert parse("child:attn+mlp") in prof.units[0].options  # frees both children's tensors: never dominated
    with pytest.raises(memfit.MemfitError, match=r"no unit has the child 'nope'.*ln_1, attn, ln_2, mlp"):
        memfit.profile(model, batch, repeat=1, granularity="fine", children=["nope"])
    with pytest.raises(memfit.MemfitError, match="granularity='fine'"):
        memfit.profile(model, batch, repeat=1, children=["attn"])


def test_cli_plans_fine_and_shows_what_each_unit_recomputes(tmp_path, capsys):
    from memfit.cli import main

    from .conftest import TINY

    (tmp_path / "tiny.toml").write_text(TINY)
    prof, out = tmp_path / "p.json", tmp_path / "s.json"
    assert main(["profile", "--scenario", str(tmp_path / "tiny.toml"), "--granularity", "fine", "--repeat", "1",
                 "-o", str(prof)]) == 0
    text = capsys.readouterr().out
    assert "finer options" in text and "child:ln_1>attn+" in text and "only ln_1→attn, ln_2→mlp.0" in text
    p = memfit.Profile.load(prof)
    budget = (memfit.min_budget_bytes(p, fine=True) + memfit.predict(p, {}).peak_bytes) // 2
    assert main(["plan", "--profile", str(prof), "--budget", str(budget), "--granularity", "fine",
                 "-o", str(out)]) == 0
    assert "recomputes" in capsys.readouterr().out
    assert main(["plan", "--profile", str(prof), "--budget", str(budget), "--children", "attn"]) == 2
    assert "--children" in capsys.readouterr().err
    assert main(["plan", "--budget", "1GB", "--children", "attn"]) == 2
    assert "--granularity fine" in capsys.readouterr().err


def _vit():
    """Hugging Face's ViT with its attention written out: a model memfit was not built around."""
    from memfit import hf

    return hf.vit(batch=4, image=64, patch=8, n_layer=3, hidden=64, n_head=2, classes=10, attention="eager")


@pytest.mark.parametrize("factory", [_vit, nano], ids=["hf-vit", "nano"])
def test_nested_regions_lower_the_floor_exactly_and_train_as_the_plain_model(factory):
    """``nested:``: the whole unit checkpointed, its attention and MLP checkpointed again inside
    (as ``torch.utils.checkpoint`` nests). The forward keeps what ``full`` keeps, plus the inner
    regions' RNG states; the unit's backward recomputes only what the inner regions leave out.
    So every unit nested peaks below every unit full, the fine floor falls below the module
    floor, a plan there is predicted to the byte, and it trains as the plain model, dropout
    included (nanoGPT's)."""
    pytest.importorskip("transformers")
    model, inputs = factory()
    prof = memfit.profile(model, inputs, repeat=1, granularity="fine")
    nested = [o for o in prof.units[0].options if isinstance(o, Nested)]
    assert len(nested) == 1
    option = nested[0]
    full, inner = prof.units[0].options[FULL], prof.units[0].options[option]
    regions = len(option.inner.regions)
    assert 0 < inner.stored_bytes - full.stored_bytes <= regions * 5056 + 64  # a CPU RNG state each
    assert inner.bwd_peak_bytes < full.bwd_peak_bytes
    every_full = memfit.predict(prof, dict.fromkeys(prof.unit_names, FULL)).peak_bytes
    every_nested = memfit.predict(prof, dict.fromkeys(prof.unit_names, option)).peak_bytes
    assert every_nested == prof.measured_peak_bytes[option] < every_full
    floor = memfit.min_budget_bytes(prof, fine=True)
    assert floor <= every_nested < memfit.min_budget_bytes(prof) == every_full
    sched = memfit.plan(prof, floor, granularity="fine")
    assert sched.predicted_peak_bytes <= floor
    measured = measure_steps(memfit.apply(copy.deepcopy(model), sched), inputs).peak_bytes
    assert measured == sched.predicted_peak_bytes
    mixed = {n: option if k % 2 == 0 else FULL for k, n in enumerate(prof.unit_names)}
    for policies in (dict.fromkeys(prof.unit_names, option), mixed):
        twin = copy.deepcopy(model)
        memfit.apply(twin, _schedule(model, policies))
        _assert_identical(_run(copy.deepcopy(model), inputs), _run(twin, inputs))
