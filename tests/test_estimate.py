"""Estimate mode: on models small enough to run here, the profile made from shapes on fake
tensors (target "cpu") predicts what the measuring profiler predicts, and what the step measures."""

import copy
import random

import pytest
import torch

import memfit
from memfit.devices import DEVICES, device_spec
from memfit.measure.fake import fake_meters
from memfit.measure.inputs import Inputs
from memfit.policy import DERIVE, FULL, KEEP, Derive, Selective, parse
from memfit.profiler import options
from memfit.profiler.estimate import estimate
from memfit.runtime.harness import measure_steps

from .conftest import tiny_gpt
from .test_fidelity import cnn_mixed, hf_gpt2, hf_llama

FACTORIES = {"gpt": tiny_gpt, "hf-gpt2": hf_gpt2, "hf-llama": hf_llama, "cnn": cnn_mixed}
TOLERANCE = 0.05


@pytest.fixture(scope="module", params=list(FACTORIES))
def both(request):
    factory = FACTORIES[request.param]
    units = "blocks.*" if request.param == "cnn" else "auto"
    model, inputs = factory()
    measured = memfit.profile(model, inputs, units=units, repeat=1)
    estimated = estimate(factory, target="cpu", units=units)
    return request.param, model, inputs, measured, estimated


def test_saved_bytes_are_exact_from_shapes(both):
    name, _, _, measured, estimated = both
    assert estimated.mode == "estimated" and estimated.target == "cpu" and measured.mode == "measured"
    if name == "hf-llama":
        # transformers' Llama builds an explicit causal mask when it sees fake tensors (is_causal
        # otherwise), and attention with a mask keeps more: 10% more here, on the cautious side
        for e, m in zip(estimated.units, measured.units, strict=True):
            assert m.saved_bytes <= e.saved_bytes <= 1.15 * m.saved_bytes
    else:
        assert [u.saved_bytes for u in estimated.units] == [u.saved_bytes for u in measured.units]
    if not name.startswith("hf-"):  # transformers builds a full causal mask when it sees fake tensors
        assert [u.input_bytes for u in estimated.units] == [u.input_bytes for u in measured.units]
    assert estimated.baseline_bytes == measured.baseline_bytes


def test_estimated_peaks_match_measured_ones(both):
    name, model, inputs, measured, estimated = both
    names = measured.unit_names
    rng = random.Random(0)
    plans = [{}, dict.fromkeys(names, FULL)] + [{n: rng.choice([KEEP, FULL]) for n in names} for _ in range(3)]
    for policies in plans:
        twin = copy.deepcopy(model)
        memfit.runtime.apply.set_policies(twin, policies)
        real = measure_steps(twin, inputs).peak_bytes
        guess = memfit.predict(estimated, policies).peak_bytes
        assert abs(guess - real) / real <= TOLERANCE, (name, policies, guess, real)


def test_a_large_model_is_estimated_without_allocating_it():
    """A GPT with 1.9 GB of float32 parameters and tens of GB of activations, which the test never
    allocates: the profile comes from shapes, and the plan fits an L4."""
    def build():
        return memfit.zoo.gpt(batch=8, seq=2048, vocab=32000, d_model=2048, n_head=16, n_layer=8)

    prof = estimate(build, target="l4")
    params = sum(p.numel() for p in memfit.zoo.GPT(vocab=32000, seq=1024, d_model=64, n_layer=1).parameters())
    assert params > 0
    assert prof.param_bytes > 1.5 * 2**30 and prof.device == "cuda" and prof.rng_state_bytes == 0
    sched = memfit.plan(prof, device_spec("l4").usable_bytes)
    assert sched.target == "l4" and sched.checkpointed
    none = memfit.predict(prof, {}).peak_bytes
    assert none > device_spec("l4").usable_bytes > sched.predicted_peak_bytes
    assert 0 < sched.predicted_overhead < 0.5


def test_roofline_times_follow_the_device():
    def build():
        return tiny_gpt()

    slow, fast = estimate(build, target="l4"), estimate(build, target="h100")
    assert fast.step_s < slow.step_s
    assert fast.units[0].options[FULL].recompute_s > 0


def test_estimate_mode_times_its_memory_steps(tmp_path, monkeypatch):
    """Estimate mode reads memory and its roofline time in one step per configuration (fake meters
    do not disturb each other), and child regions need no warm-up there: the profile is byte for
    byte the one that separate memory and time steps give, from fewer steps. Real meters refuse to
    be read together."""
    import dataclasses

    from memfit import zoo
    from memfit.measure.meters import real_meters
    from memfit.profiler import estimate as estimate_module
    from memfit.runtime import harness, marks

    def small_gpt():  # attention written out, dropout: derive levels, child regions and an op set
        return zoo.nanogpt(batch=2, seq=32, vocab=128, d_model=32, n_head=2, n_layer=2, dropout=0.1)

    monkeypatch.setattr(options, "CHILD_DERIVES", (DERIVE,))  # the op set is offered where derive:products is not

    steps = []

    def counted(*args, **kwargs):
        steps.append(args[-1])
        return marks.recorded_step(*args, **kwargs)

    monkeypatch.setattr(harness, "recorded_step", counted)
    paths = []
    for together in (True, False):
        if not together:  # the fake meters, read one at a time
            monkeypatch.setattr(estimate_module, "fake_meters", lambda *a, **k: dataclasses.replace(
                fake_meters(*a, **k), together=False))
        steps.clear()
        prof = estimate(small_gpt, target="h100", granularity="fine", children=["attn"])
        paths.append(tmp_path / f"{together}.json")
        prof.save(paths[-1])
        kinds = {w: steps.count(w) for w in set(steps)}
        offered = set(prof.measured_peak_bytes)
        assert any(isinstance(o, Selective) for o in offered) and any(isinstance(o, Derive) for o in offered)
        assert any(str(o).startswith("child:") for o in offered)
        configs = len(prof.measured_peak_bytes)  # one memory step per all-units option
        if together:
            assert kinds == {"both": configs, "time": 1}  # and the units two by two, timed alone
        else:  # each timed, the finer ones after a step that learns (derive's plan)
            learners = sum(o not in (KEEP, FULL) for o in prof.measured_peak_bytes)
            assert learners > 0 and kinds == {"memory": configs, "time": configs + learners + 1}
    assert paths[0].read_text() == paths[1].read_text()
    model, batch = small_gpt()
    with pytest.raises(ValueError, match="disturb each other"):
        harness.StepHarness(model, batch).marked_step(harness.StepHarness(model, batch).new_state(), ["blocks.0"],
                                                      "both", real_meters(torch.device("cpu")))


def test_unknown_target_and_every_spec_is_sane():
    with pytest.raises(memfit.MemfitError, match="unknown target 'tpu'"):
        estimate(tiny_gpt, target="tpu")
    for d in DEVICES.values():
        assert d.usable_bytes < d.memory_bytes or not d.cuda
        assert d.flops_per_s(torch.bfloat16) >= d.flops_per_s(torch.float32) or not d.cuda


def test_inputs_are_described_like_measured_ones():
    prof = estimate(tiny_gpt, target="cpu")
    _, batch = tiny_gpt()
    assert prof.input_shapes == Inputs.of(batch).describe()


def test_default_plan_is_estimated_for_a_24gb_gpu_and_matters(tmp_path, capsys):
    """`memfit plan --budget 24GB`, the first command of the README, with no GPU here: the default
    0.73B GPT in amp-bf16 is estimated for an RTX 4090; unplanned it would not fit, planned it does,
    within what the card leaves to a step (20.67 GiB)."""
    from memfit.cli import main

    out = tmp_path / "s.json"
    assert main(["plan", "--budget", "24GB", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "estimated for NVIDIA GeForce RTX 4090 (rtx4090)" in text
    sched = memfit.load_schedule(out)
    assert sched.target == "rtx4090" and sched.device == "cuda" and sched.checkpointed
    assert sched.baselines["none"]["peak_bytes"] > 24 * 2**30 >= sched.predicted_peak_bytes
    assert sched.predicted_peak_bytes <= sched.budget_bytes == DEVICES["rtx4090"].usable_bytes
    assert sched.asked_budget_bytes == 24 * 2**30 and sched.step["precision"] == "amp-bf16"
    assert main(["validate", "--schedule", str(out)]) == 2
    assert "estimated for rtx4090 without one; validate it on that GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--target", "tpu"], "unknown target 'tpu'; known: v100-16gb"),
    (["--target", "h100", "--device", "cpu"], "--target estimates for a device without using one"),
])
def test_target_mistakes(args, message, capsys):
    from memfit.cli import main

    assert main(["plan", "--budget", "24GB", *args]) == 2
    assert message in capsys.readouterr().err


def test_scenario_target_is_checked(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "memfit.zoo:gpt"\ntarget = "h1000"\n')
    with pytest.raises(memfit.MemfitError, match="field 'target' must be one of"):
        memfit.scenarios.load_scenario(str(bad))


def test_llama_7b_is_planned_for_an_h100_from_shapes():
    """The real-size scenario: 6.7B parameters in bf16 (12.6 GiB) never allocated; one layer
    keeps what the closed form below says."""
    pytest.importorskip("transformers")
    sc = memfit.scenarios.load_scenario("llama2-7b")
    prof = estimate(lambda: sc.build("cpu"), target="h100", units=sc.units, optimizer=sc.optimizer)
    assert 12.4 * 2**30 < prof.param_bytes < 12.7 * 2**30
    # Per layer at 16-bit with s*b tokens, hidden h, intermediate i (HF Llama: RMSNorm in float32,
    # rotary embedding, fused attention, SwiGLU, no dropout), bytes saved for backward:
    #   two RMSNorms: float32 input (4) + normalised bf16 (2) each           12 sbh
    #   attention: q, k, v projections' input (2); q, k, v after the rotary
    #     embedding (6: it multiplies by constant cos/sin, so it keeps only
    #     those); attention output (2) and the o_proj input copy (2)          12 sbh
    #   MLP: gate/up input (2); gate, up, SiLU(gate), product (2 each)         2 sbh + 8 sbi
    # i.e. (26 + 8 i/h) sbh. Megatron-LM's s*b*h*(34 + 5as/h) is LayerNorms 4, attention 11 +
    # 5as/h, GeLU MLP 19, with dropout masks; adjusted: fused attention keeps no s*s matrix (the
    # 5as/h term goes; its logsumexp, 4asb, is negligible) and no dropout masks, float32 RMSNorms
    # 12 instead of 4, SwiGLU 2 + 8i/h instead of 19. Llama-2-7B: i/h = 2.6875, so 47.5 sbh.
    s_b_h = 4096 * 1 * 4096
    closed = (26 + 8 * 11008 / 4096) * s_b_h
    kept = prof.units[5].saved_bytes
    assert abs(kept - closed) / closed <= 0.10, (kept, closed)


def test_a_plan_warns_when_it_runs_on_another_device_than_it_was_made_for():
    """A schedule estimated for an H100, or measured on CUDA, run on the CPU: the first training
    forward says the plan was made for another device (not apply, which may come before
    ``model.cuda()``); one estimated for the CPU target, or measured there, says nothing."""
    import dataclasses
    import warnings

    prof = estimate(tiny_gpt, target="h100")
    sched = memfit.plan(prof, memfit.predict(prof, {}).peak_bytes)
    model, batch = tiny_gpt()
    memfit.apply(model, sched)
    with pytest.warns(memfit.PlanDriftWarning, match=r"estimated for NVIDIA H100 80GB HBM3 \(h100\).*the CPU"):
        model(**batch)
    memfit.remove(model)
    measured = dataclasses.replace(memfit.plan(estimate(tiny_gpt, target="cpu"), 2**40), target="", device="cuda:0")
    memfit.apply(model, measured)
    with pytest.warns(memfit.PlanDriftWarning, match=r"measured on cuda:0 and the model runs on the CPU"):
        model(**batch)
    memfit.remove(model)
    for quiet in (memfit.plan(estimate(tiny_gpt, target="cpu"), 2**40), dataclasses.replace(measured, device="cpu")):
        memfit.apply(model, quiet)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(**batch)
        memfit.remove(model)


def test_a_model_too_large_to_measure_points_to_estimate_mode(monkeypatch, tmp_path, capsys):
    """A GPU smaller than the plain step runs out of memory while profiling: the error says to
    estimate with --target, with exit code 2 and no traceback."""
    from memfit.cli import main

    from .conftest import TINY

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("memfit.profiler.profile", out_of_memory)
    (tmp_path / "tiny.toml").write_text(TINY)
    assert main(["plan", "--budget", "1GB", "--scenario", str(tmp_path / "tiny.toml")]) == 2
    err = capsys.readouterr().err
    assert "tiny does not fit cpu unplanned" in err and "--target (one of v100-16gb" in err
    assert "Traceback" not in err


def test_foreach_optimizer_step_is_counted_as_measured():
    """AdamW's foreach kernels (what PyTorch picks on CUDA, and estimate mode on CUDA targets)
    hold a copy of the second moments during the step (``_foreach_sqrt``): on real tensors here,
    the step's peak rises by the parameters' bytes over the one-tensor path's, the estimate on
    fake tensors says the same, and a plan whose peak is in the step is predicted exactly."""
    from memfit.runtime.harness import StepHarness

    model, inputs = tiny_gpt()
    foreach = memfit.profile(model, inputs, repeat=1, optimizer="adamw-foreach")
    single = memfit.profile(model, inputs, repeat=1, optimizer="adamw")  # the CPU's own choice: one at a time
    estimated = estimate(tiny_gpt, target="cpu", optimizer="adamw-foreach")
    step = [p.peak_bytes for p in foreach.phases if p.label == "optimizer step"]
    single_step = [p.peak_bytes for p in single.phases if p.label == "optimizer step"]
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # one tensor at a time: a couple of temporaries of the largest parameter; foreach: all at once
    assert single_step[0] <= 2 * largest + 4096 < foreach.param_bytes <= step[0] <= foreach.param_bytes + 1024
    full = dict.fromkeys(foreach.unit_names, FULL)
    assert memfit.predict(foreach, full).peak_phase == "optimizer step"
    twin = copy.deepcopy(model)
    memfit.runtime.apply.set_policies(twin, full)
    real = StepHarness(twin, inputs, step=memfit.TrainStep("adamw-foreach")).run().peak_bytes
    assert memfit.predict(foreach, full).peak_bytes == real
    assert abs(memfit.predict(estimated, full).peak_bytes - real) <= 0.001 * real


def test_cuda_targets_take_the_foreach_kernels():
    """Estimated for a CUDA target, the step holds AdamW's foreach temporaries; for the CPU it
    does not (PyTorch's own choice on each)."""
    cuda = estimate(tiny_gpt, target="h100")
    cpu = estimate(tiny_gpt, target="cpu")
    step = {p.label: p.peak_bytes for p in cuda.phases}["optimizer step"]
    cpu_step = {p.label: p.peak_bytes for p in cpu.phases}["optimizer step"]
    assert step >= cuda.param_bytes > cpu_step


def test_host_costs_change_an_overhead_bound_plan_for_an_h100(tmp_path, monkeypatch):
    """A GPT of small hidden size on an H100: its kernels take a microsecond or two, so what its
    options cost is the host's time per op, per hooked op and per op through a dispatch mode.
    Priced without them, the plan takes options that look free; priced with them it takes
    another plan, never dearer by its own measure and cheaper at some budgets (since
    ``derive:all``, which is cheap both ways, the two often cost the same: the sweep shows where
    they part)."""
    import dataclasses

    from memfit import zoo
    from memfit.devices import load_device_spec

    h100 = device_spec("h100")

    def build():
        return zoo.gpt(batch=8, seq=128, vocab=512, d_model=64, n_head=4, n_layer=4, dropout=0.0)

    bare_device = dataclasses.replace(h100, launch_s=0.0, hook_s=0.0)
    assert bare_device.seconds(1e3, 1e3, torch.float32) < 1e-8  # a tiny op, kernels only
    assert h100.seconds(1e3, 1e3, torch.float32) == h100.launch_s
    assert h100.seconds(1e3, 1e3, torch.float32, hooked=True) == h100.launch_s + h100.hook_s
    priced = estimate(build, target=h100, granularity="fine")
    bare = estimate(build, target=bare_device, granularity="fine")
    for prof in (priced, bare):
        u = prof.units[0].options  # (plain derive keeps what the child chains keep here, and is dropped where dearer)
        assert u[parse("derive:all")].stored_bytes < u[KEEP].stored_bytes
    # the host's time makes recomputing a block cost what its ops' launches cost, not its FLOPs
    assert priced.units[0].options[FULL].recompute_s > 10 * bare.units[0].options[FULL].recompute_s
    none = memfit.predict(priced, {}).peak_bytes
    full = memfit.predict(priced, dict.fromkeys(priced.unit_names, FULL)).peak_bytes
    shares = (0.1, 0.3, 0.5, 0.7, 0.9)
    ratios, differ = [], 0
    for share in shares:
        budget = int(full + share * (none - full))
        chosen = memfit.plan(priced, budget, granularity="fine")
        blind = memfit.plan(bare, budget, granularity="fine")
        differ += chosen.policies != blind.policies
        cost = memfit.predict(priced, chosen.policies).recompute_s
        ratios.append(cost / memfit.predict(priced, blind.policies).recompute_s)
    # (at the tightest budget both take derive:all on every block: since a recipe finds an input
    # by its kept storage, derive:all sheds enough on this GPT there, cheap priced and unpriced)
    assert differ >= 3 and max(ratios) <= 1 and min(ratios) < 0.95, (differ, ratios)
    # where the gemm op set was offered on a child, derive on that child is: no op passes a dispatch mode
    assert not any(isinstance(k, Selective) for k in priced.units[0].options)
    assert any(isinstance(k, Derive) and k.child for u in priced.units for k in u.options)
    # an op set's two Python dispatch modes (SAC's) cost the host per op they see, and are priced
    # so; no other option opens one (written-out attention, whose core the weights op set recomputes,
    # dropout included: offered where derive:products is not); priced, no plan takes one (on the
    # GPT above, before derive@<child> replaced the gemm op set on a child, the unpriced plans took
    # that op set on the MLP at some budgets)
    assert h100.seconds(1e3, 1e3, torch.float32, dispatched=True) == h100.launch_s + h100.dispatch_s

    def written_out():
        return zoo.nanogpt(batch=8, seq=128, vocab=512, d_model=64, n_head=4, n_layer=2, dropout=0.1)

    # the op set is offered on a module where derive:products is not (here: not tried on a child)
    monkeypatch.setattr(options, "CHILD_DERIVES", (DERIVE,))
    priced = estimate(written_out, target=h100, granularity="fine")
    undispatched = estimate(written_out, target=dataclasses.replace(h100, dispatch_s=0.0), granularity="fine")
    sac = [k for k in priced.units[0].options if isinstance(k, Selective)]
    assert sac
    for k in sac:  # attention's forward and recomputation pass some 9 ops each through the modes
        extra = priced.units[0].options[k].recompute_s - undispatched.units[0].options[k].recompute_s
        assert extra > 12 * h100.dispatch_s
    for k in set(priced.units[0].options) - set(sac):  # no other option opens a dispatch mode
        assert priced.units[0].options[k].recompute_s == undispatched.units[0].options[k].recompute_s
    none = memfit.predict(priced, {}).peak_bytes
    full = memfit.predict(priced, dict.fromkeys(priced.unit_names, FULL)).peak_bytes
    for share in shares:
        chosen = memfit.plan(priced, int(full + share * (none - full)), granularity="fine")
        assert not any(isinstance(p, Selective) for p in chosen.policies.values())
    # a spec file sets the host's times (a card in a slower host, say), in microseconds
    spec = tmp_path / "slow-host.toml"
    spec.write_text('base = "h100"\nlaunch_us = 12\nhook_us = 9\ndispatch_us = 20\n')
    slow = load_device_spec(spec)
    assert (slow.launch_s, slow.hook_s, slow.dispatch_s) == (
        pytest.approx(12e-6), pytest.approx(9e-6), pytest.approx(20e-6))
    spec.write_text('base = "h100"\nlaunch_us = -1\n')
    with pytest.raises(memfit.MemfitError, match="launch_us must be a number of microseconds"):
        load_device_spec(spec)
