"""One schedule for several input shapes (issue 25): profiles of one model at three sequence
lengths (or two image sizes) planned at one budget; a user's loop written here alternates
batches of every shape, and each step's peak, measured with the exact CPU meter, is compared with
its shape's predicted peak and the budget; losses and gradients with a plain copy's."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch

import memfit
from memfit.errors import InfeasibleBudgetError, MemfitError, PlanDriftWarning
from memfit.formats.schedule import load_schedule
from memfit.measure.memory import measured
from memfit.policy import FULL, KEEP, Segment, parse
from memfit.zoo import gpt

from .test_train_step import UserLoop

LENGTHS = (64, 128, 256)


def _at(batch: dict, length: int) -> dict:
    """The batch cut to ``length`` along the sequence (what a bucketing collator gives)."""
    return {k: v[:, :length].contiguous() if torch.is_tensor(v) and v.dim() > 1 else v for k, v in batch.items()}


def _applied(model) -> int:
    return model.__dict__["_memfit_applied"].shape  # the plan the last forward ran


def _measured_step(loop: UserLoop) -> tuple[torch.Tensor, int]:
    """One step of the loop and its peak: what lives across steps (counted) plus the highest rise
    the exact CPU meter sees during it. Gradients are left for the caller to compare."""
    loop.opt.zero_grad(set_to_none=True)
    state = [v for s in loop.opt.state.values() for v in s.values() if torch.is_tensor(v)]
    loss, peak, _ = measured(loop.step, lambda: [*loop.model.parameters(), *loop.model.buffers(), *state,
                                                 *(v for v in loop.batch.values() if torch.is_tensor(v))])
    return loss, peak


def _train_alternating(model, batches: list[dict], schedule, rounds: int = 2):
    """A plain copy and the scheduled model, each trained by its own loop on the same batches in
    turn; yields (batch index, the scheduled step's measured peak, the model) after checking that
    both models' losses and gradients agree, for every step but the first."""
    plain, scheduled = copy.deepcopy(model), memfit.apply(copy.deepcopy(model), schedule)
    for m in (plain, scheduled):
        m.train()
    loops = [UserLoop(m, batches[0], "adamw", 1, "fp32", None) for m in (plain, scheduled)]
    for r in range(rounds):
        for k, batch in enumerate(batches):
            loops[0].batch = loops[1].batch = batch
            torch.manual_seed(10 * r + k)  # the same dropout in both
            loss = loops[0].step()
            torch.manual_seed(10 * r + k)
            scheduled_loss, peak = _measured_step(loops[1])
            assert torch.equal(loss, scheduled_loss), (r, k)
            for (n, p), q in zip(plain.named_parameters(), scheduled.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (r, k, n)
            if r or k:  # the first step creates AdamW's state: the plans are for the steps after
                yield k, peak, scheduled


@pytest.fixture(scope="module")
def gpt_shapes():
    model, batch = gpt(batch=4, seq=320, vocab=256, d_model=64, n_head=2, n_layer=4)  # positions up to 320
    profiles = [memfit.profile(model, _at(batch, n), repeat=1) for n in LENGTHS]
    return model, batch, profiles


def test_each_length_runs_its_own_plan_within_the_budget(gpt_shapes, tmp_path):
    model, batch, profiles = gpt_shapes
    plain_peaks = [memfit.predict(p, {}).peak_bytes for p in profiles]
    budget = int(0.9 * plain_peaks[1])  # 64 fits unplanned, 128 needs a little, 256 much
    schedule = memfit.plan(profiles, budget)
    schedule.save(tmp_path / "s.json")
    schedule = load_schedule(tmp_path / "s.json")  # as a training script loads it
    plans = schedule.plans
    assert [p.input_shapes for p in plans] == [p.input_shapes for p in profiles]  # smallest first
    assert schedule.policies == plans[-1].policies and schedule.predicted_peak_bytes == plans[-1].predicted_peak_bytes
    assert not plans[0].checkpointed and plans[1].checkpointed
    assert len(plans[2].checkpointed) >= len(plans[1].checkpointed)  # the longest recomputes the most units
    assert all(p.predicted_peak_bytes <= budget for p in plans)
    order = [2, 0, 1, 2, 1, 0]  # every switch, both ways
    batches = [_at(batch, LENGTHS[k]) for k in order]
    for k, peak, scheduled in _train_alternating(model, batches, schedule):
        predicted = plans[order[k]].predicted_peak_bytes
        assert _applied(scheduled) == order[k]
        assert peak <= budget, (LENGTHS[order[k]], peak, budget)
        assert abs(peak - predicted) <= 0.01 * predicted, (LENGTHS[order[k]], peak, predicted)
    assert json.loads((tmp_path / "s.json").read_text())["shapes"][0]["input_shapes"] == profiles[0].input_shapes


def test_an_unseen_length_takes_the_plan_that_covers_it_and_a_longer_one_warns_once(gpt_shapes):
    model, batch, profiles = gpt_shapes
    budget = int(0.9 * memfit.predict(profiles[1], {}).peak_bytes)
    schedule = memfit.plan(profiles, budget)
    plan_128 = schedule.plans[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanDriftWarning)  # between planned lengths: covered, quiet
        for _, peak, scheduled in _train_alternating(model, [_at(batch, 96)], schedule, rounds=2):
            assert _applied(scheduled) == 1  # 128 covers 96; 64 does not
            assert peak <= plan_128.predicted_peak_bytes <= budget
    scheduled = memfit.apply(copy.deepcopy(model), schedule)
    with pytest.warns(PlanDriftWarning, match=r"the largest of its 3 input shapes.*int64\[4,320\].*"
                      r"profile it at these inputs too") as said:
        for _ in range(3):
            scheduled(**batch)["loss"].backward()
    assert len([w for w in said if issubclass(w.category, PlanDriftWarning)]) == 1
    assert _applied(scheduled) == 2  # the largest plan, the most recompute
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanDriftWarning)
        scheduled(**_at(batch, 64))["loss"].backward()  # back to a planned one: its plan, quiet
    assert _applied(scheduled) == 0


def test_tighten_steps_down_the_ladder_of_the_shape_that_runs(gpt_shapes):
    model, batch, profiles = gpt_shapes
    schedule = memfit.plan(profiles, memfit.predict(profiles[2], {}).peak_bytes, fallbacks=2)
    scheduled = memfit.apply(copy.deepcopy(model), schedule)
    scheduled(**_at(batch, 256))["loss"].backward()
    assert memfit.tighten(scheduled)
    ladder = schedule.plans[2].fallbacks
    assert {n for n, p in ladder[0]["policies"].items() if p != KEEP} == {
        n for n in ladder[0]["policies"] if memfit.runtime.apply.is_checkpointed(scheduled.get_submodule(n))}
    scheduled(**_at(batch, 64))["loss"].backward()  # the short shape's own plan, untightened
    assert not any(memfit.runtime.apply.is_checkpointed(b) for b in scheduled.h)


def test_plan_refuses_profiles_of_other_models_or_steps_and_names_the_budget_every_shape_needs(gpt_shapes):
    model, batch, profiles = gpt_shapes
    other, other_batch = gpt(batch=4, seq=320, vocab=256, d_model=64, n_head=2, n_layer=3)
    with pytest.raises(MemfitError, match="different models"):
        memfit.plan([profiles[0], memfit.profile(other, _at(other_batch, 64), repeat=1)], "1GB")
    with pytest.raises(MemfitError, match="same inputs"):
        memfit.plan([profiles[0], profiles[0]], "1GB")
    with pytest.raises(MemfitError, match="differ in optimizer"):
        memfit.plan([profiles[0], memfit.profile(model, _at(batch, 128), repeat=1, step=memfit.TrainStep("sgd"))],
                    "1GB")
    least = [memfit.min_budget_bytes(p) for p in profiles]
    with pytest.raises(InfeasibleBudgetError, match=r"int64\[4,256\]") as exc:
        memfit.plan(profiles, (least[1] + least[2]) // 2)
    assert exc.value.min_budget_bytes == least[2]
    with pytest.raises(MemfitError, match="shares"):
        memfit.plan(profiles, "1GB", shares=[1, 2])


def test_expected_overhead_weighs_each_shape_by_its_share(gpt_shapes):
    _, _, profiles = gpt_shapes
    budget = int(0.9 * memfit.predict(profiles[1], {}).peak_bytes)
    schedule = memfit.plan(profiles, budget, shares=[6, 3, 1])
    overheads = [p.predicted_overhead for p in schedule.plans]
    assert [p.share for p in schedule.plans] == [0.6, 0.3, 0.1]
    assert schedule.expected_overhead == pytest.approx(0.6 * overheads[0] + 0.3 * overheads[1] + 0.1 * overheads[2])
    assert schedule.expected_overhead <= max(overheads)


def _padded(ids: torch.Tensor) -> dict:
    mask = torch.ones_like(ids)
    mask[0, ids.shape[1] * 3 // 4:] = 0  # padded on the right, as a collator pads
    mask[1, :3] = 0  # and on the left
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_hugging_face_gpt2_with_padded_attention_masks_at_three_lengths(attn="sdpa"):  # HF's default
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=128,
                                     attn_implementation=attn)  # use_cache=True, its default
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (4, 128))
    lengths = (32, 64, 128)
    profiles = [memfit.profile(model, _padded(ids[:, :n]), repeat=1) for n in lengths]
    budget = int(0.95 * memfit.predict(profiles[1], {}).peak_bytes)
    schedule = memfit.plan(profiles, budget)
    plans = schedule.plans
    assert not plans[0].checkpointed and len(plans[2].checkpointed) >= len(plans[1].checkpointed) > 0
    order = [2, 0, 1, 0, 2, 1]
    for k, peak, scheduled in _train_alternating(model, [_padded(ids[:, :lengths[j]]) for j in order], schedule):
        predicted = plans[order[k]].predicted_peak_bytes
        assert _applied(scheduled) == order[k]
        assert peak <= budget and abs(peak - predicted) <= 0.01 * predicted, (lengths[order[k]], peak, predicted)


def test_a_vit_at_two_resolutions():
    pytest.importorskip("transformers")
    from memfit.hf import vit

    model, batch = vit(batch=4, image=64, patch=8, n_layer=3, hidden=64, n_head=2, classes=10)
    small = {"pixel_values": torch.nn.functional.interpolate(batch["pixel_values"], size=32), "labels": batch["labels"],
             "interpolate_pos_encoding": True}  # a ViT fine-tuned at another resolution, as HF does it
    large = {**batch, "interpolate_pos_encoding": True}
    profiles = [memfit.profile(model, b, repeat=1) for b in (large, small)]  # in any order
    budget = int(0.8 * memfit.predict(profiles[0], {}).peak_bytes)
    schedule = memfit.plan(profiles, budget)
    plans = schedule.plans
    assert [p.input_shapes for p in plans] == [profiles[1].input_shapes, profiles[0].input_shapes]
    assert not plans[0].checkpointed and plans[1].checkpointed
    order = [1, 0, 0, 1]
    for k, peak, scheduled in _train_alternating(model, [(small, large)[j] for j in order], schedule):
        predicted = plans[order[k]].predicted_peak_bytes
        assert _applied(scheduled) == order[k]
        assert peak <= budget and abs(peak - predicted) <= 0.01 * predicted, (order[k], peak, predicted)


def test_inputs_cut_to_a_length_and_a_histogram_counted_toward_the_covering_length(tmp_path):
    from memfit.lengths import cut_to_length, parse_lengths, read_histogram

    ids = torch.arange(24).view(2, 12)
    cut = cut_to_length({"input_ids": ids, "labels": ids, "mask": torch.ones(2, 1, 12), "flag": True}, 5)
    assert cut["input_ids"].shape == (2, 5) and torch.equal(cut["labels"], ids[:, :5]) and cut["flag"] is True
    assert cut["mask"].shape == (2, 1, 12)  # its second dimension is not the sequence
    with pytest.raises(MemfitError, match="shorter than the sequence length 16"):
        cut_to_length((ids,), 16)
    with pytest.raises(MemfitError, match="no tensor with a sequence dimension"):
        cut_to_length((torch.ones(3),), 2)
    assert parse_lengths("256, 64,128") == [64, 128, 256]
    for bad in ("64,64", "", "64,x", [64, 1.5]):
        with pytest.raises(MemfitError, match="distinct positive integers"):
            parse_lengths(bad)
    hist = tmp_path / "h.csv"
    hist.write_text("length,count\n64,3\n65,1\n\n128,4\n")
    assert read_histogram(str(hist), [64, 128, 256]) == [3.0, 5.0, 0.0]
    hist.write_text("64,1\n300,1\n")
    with pytest.raises(MemfitError, match="300 is longer than every planned one"):
        read_histogram(str(hist), [64, 256])
    hist.write_text("64,1\n128,many\n")
    with pytest.raises(MemfitError, match="line 2"):
        read_histogram(str(hist), [64, 256])


def test_a_compiled_model_switches_plans_between_shapes_outside_its_graphs():
    from memfit.errors import EagerPlanCompiledWarning
    from memfit.runtime.apply import is_checkpointed

    model, batch = gpt(batch=4, seq=128, vocab=256, d_model=64, n_head=2, n_layer=4, dropout=0.0)
    profiles = [memfit.profile(model, _at(batch, n), repeat=1) for n in (32, 128)]
    schedule = memfit.plan(profiles, int(0.8 * memfit.predict(profiles[1], {}).peak_bytes))
    assert not schedule.plans[0].checkpointed and schedule.plans[1].checkpointed
    plain, scheduled = copy.deepcopy(model), memfit.apply(copy.deepcopy(model), schedule)
    compiled = [torch.compile(m, backend="aot_eager") for m in (plain, scheduled)]

    def peak(m, n) -> int:  # one compiled forward and backward's rise, gradients left for the caller
        def step() -> torch.Tensor:
            loss = m(**_at(batch, n))["loss"]
            loss.backward()
            return loss.detach()
        return measured(step, list)[:2]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerPlanCompiledWarning)  # an eager plan, compiled: said once
        for n in (128, 32, 128, 32):
            (a, plain_peak), (b, sched_peak) = (peak(m, n) for m in compiled)
            assert torch.equal(a, b)
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), scheduled.parameters(),
                                                                    strict=True))
            for m in (plain, scheduled):
                m.zero_grad(set_to_none=True)
            policies = schedule.plans[1 if n == 128 else 0].policies
            assert [is_checkpointed(scheduled.get_submodule(u)) for u in policies] == [
                p != KEEP for p in policies.values()]
            assert (sched_peak == plain_peak) if n == 32 else (sched_peak < plain_peak)  # the graph follows the plan
    memfit.remove(scheduled)
    assert not any(is_checkpointed(u) for u in scheduled.h) and not scheduled._forward_pre_hooks


@pytest.mark.parametrize(("long", "short"), [("full", "none"), ("none", "full"), ("full", "derive"),
                                             ("segment", "derive:products")])
def test_two_forwards_of_two_shapes_before_one_backward_give_the_plain_gradients(long, short):
    """The second forward switches plans while the first one's graph waits for its backward:
    the first one's recomputation still replays its own plan's regions."""
    from memfit.formats.schedule import Schedule, model_fingerprint
    from memfit.measure.inputs import Inputs

    model, batch = gpt(batch=2, seq=16, vocab=128, d_model=32, n_head=2, n_layer=4, seed=0)  # with dropout
    names = [f"h.{i}" for i in range(4)]
    seg = Segment("h.0", "h.2")
    policies = {p: {**dict.fromkeys(names[:3], seg), "h.3": FULL} if p == "segment" else
                dict.fromkeys(names, parse(p)) for p in (long, short)}
    plans = [Schedule(policies[p], 2**40, 0, 0.0, 0.0, "test", "none", "none", 0.0, model_fingerprint(model, names),
                      input_shapes=Inputs.of(x).describe()) for p, x in ((short, _at(batch, 8)), (long, batch))]
    schedule = dataclasses.replace(plans[1], shapes=plans)
    plain, scheduled = copy.deepcopy(model), memfit.apply(copy.deepcopy(model), schedule)
    losses = []
    for m in (plain, scheduled):
        torch.manual_seed(0)
        loss = memfit.default_loss(m(**batch)) + memfit.default_loss(m(**_at(batch, 8)))
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(*losses)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), scheduled.parameters(), strict=True))
