"""The step users run (memfit.TrainStep): gradient accumulation, amp-bf16 autocast over fp32
weights, clipping, optimizers by name or the user's own. Each plan's predicted peak is compared
with the peak of a loop written here as a user writes it (not memfit's harness), measured with
the exact CPU meter from a byte count of what lives across steps done by hand; the scheduled
model's gradients equal the plain model's under that loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.errors import MemfitError, ScheduleMismatchError
from memfit.formats.profile import Profile, profile_from_dict
from memfit.formats.schedule import Schedule, model_fingerprint
from memfit.measure.memory import measured
from memfit.policy import FULL, KEEP

from .conftest import pairwise, tiny_gpt


def user_optimizer(params):  # an optimizer of the user's own, with a learning rate that moves the weights
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "callable": user_optimizer,
}


def _loss(out) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) and "loss" in out else out.loss


class UserLoop:
    """A training loop as people write it: ``zero_grad``, micro-batches under autocast with the
    loss divided by their number, clipping, ``step``."""

    def __init__(self, model: nn.Module, batch: dict, optimizer: str, accumulate: int, precision: str,
                 clip: float | None, keep_output: bool = False) -> None:
        self.model, self.batch, self.accumulate, self.clip = model, batch, accumulate, clip
        self.keep_output = keep_output  # a loop variable, as nanoGPT's logits: alive until the next forward returns
        self.out = None
        self.amp = precision.startswith("amp-")
        self.dtype = torch.float16 if precision == "amp-fp16" else torch.bfloat16
        self.scaler = torch.amp.GradScaler("cpu") if precision == "amp-fp16" else None
        self.opt = OPTIMIZERS[optimizer](model.parameters())
        self.autocast_cache = True  # False: autocast(cache_enabled=False), as Lightning runs it

    def step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for _ in range(self.accumulate):
            with torch.autocast("cpu", dtype=self.dtype, enabled=self.amp, cache_enabled=self.autocast_cache):
                if self.keep_output:
                    self.out = self.model(**self.batch)
                    loss = _loss(self.out)
                else:
                    loss = _loss(self.model(**self.batch))
            scaled = loss / self.accumulate
            (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            total += loss.detach().float()
        if self.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        return total

    def peak(self) -> int:
        """The peak of one steady-state step: what lives across steps (counted here, the last
        step's output too, which goes when this step makes its own) plus the highest rise the meter
        sees during the step."""
        self.opt.zero_grad(set_to_none=True)

        def static() -> list[torch.Tensor]:  # listed when asked: nothing here holds the last output
            state = [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
            held = [v for v in (self.out or {}).values() if torch.is_tensor(v)]
            if self.scaler is not None:  # its scale and growth tracker
                held += [self.scaler._scale, self.scaler._growth_tracker]
            return [*self.model.parameters(), *self.model.buffers(), *state, *self.batch.values(), *held]
        return measured(self.step, static)[1]


def _apply(model: nn.Module, policies: dict[str, str]) -> nn.Module:
    """The schedule applied as users apply it, a plan that checkpoints nothing too (a scheduled
    Hugging Face model keeps no KV cache in training forwards, as its own checkpointing does)."""
    memfit.apply(model, Schedule(policies, 1, 0, 0.0, 0.0, "test", "none", "none", 0.0,
                                 model_fingerprint(model, list(policies))))
    return model


def _plans(names: list[str]) -> dict[str, dict[str, str]]:
    return {"none": dict.fromkeys(names, KEEP), "full": dict.fromkeys(names, FULL),
            "mixed": {n: FULL if i % 2 else KEEP for i, n in enumerate(names)}}


def check_step(build, optimizer: str, accumulate: int, precision: str, clip: float | None,
               keep_output: bool = False) -> memfit.Profile:
    model, batch = build()
    step = memfit.TrainStep(optimizer=user_optimizer if optimizer == "callable" else optimizer,
                            accumulate=accumulate, precision=precision, clip_grad_norm=clip, keep_output=keep_output)
    before = [p.detach().clone() for p in model.parameters()]
    prof = memfit.profile(model, batch, step=step, repeat=1)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # left as it was
    assert prof.step["accumulate"] == accumulate and prof.step["precision"] == precision
    # segments' members are timed in pairs only where segments can be planned (no autocast)
    assert all((u.member_s is not None) == prof.segmentable for u in prof.units)
    for kind, policies in _plans(prof.unit_names).items():
        predicted = memfit.predict(prof, policies).peak_bytes
        plain, scheduled = copy.deepcopy(model), _apply(copy.deepcopy(model), policies)
        loops = [UserLoop(m, batch, optimizer, accumulate, precision, clip, keep_output) for m in (plain, scheduled)]
        for m in (plain, scheduled):
            m.train()
        for i in range(2):  # the first step creates the optimizer state; the second is steady
            losses = []
            for loop in loops:
                torch.manual_seed(i)
                losses.append(loop.step())
            assert torch.equal(*losses), (kind, i)
            for (n, p), q in zip(plain.named_parameters(), scheduled.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (kind, n)
        torch.manual_seed(2)
        measured = loops[1].peak()
        assert abs(predicted - measured) <= 0.01 * measured, (kind, predicted, measured)
    return prof


@pytest.mark.parametrize(("optimizer", "accumulate", "precision", "clip"), pairwise(
    OPTIMIZERS, (1, 3), ("fp32", "amp-bf16"), (None, 1.0)))
def test_gpt_plans_hold_in_the_users_loop(optimizer, accumulate, precision, clip):
    check_step(tiny_gpt, optimizer, accumulate, precision, clip)


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)  # its defaults: dropout 0.1, eager attention
    ids = torch.randint(0, 512, (2, 32))
    return model, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(("optimizer", "accumulate", "precision", "clip"), pairwise(
    OPTIMIZERS, (1, 3), ("fp32", "amp-bf16"), (None, 1.0)))
def test_hf_gpt2_plans_hold_in_the_users_loop(optimizer, accumulate, precision, clip):
    check_step(_hf_gpt2, optimizer, accumulate, precision, clip)


@pytest.mark.parametrize("build", [tiny_gpt, _hf_gpt2])
def test_a_loop_that_keeps_the_output_through_the_backward(build):
    """``out = model(**batch); out.loss.backward()`` (HF's examples, nanoGPT's ``logits, loss``)
    holds the logits through the backward: planned with keep_output=True, predicted = measured."""
    kept = check_step(build, "adamw", 2, "amp-bf16", None, keep_output=True)
    dropped = memfit.profile(*build(), step=memfit.TrainStep(accumulate=2, precision="amp-bf16"), repeat=1)
    assert memfit.predict(kept, {}).peak_bytes > memfit.predict(dropped, {}).peak_bytes


def test_amp_fp16_with_a_grad_scaler_holds_and_is_estimated_alike():
    """amp-fp16 with a GradScaler (unscaled before clipping) in the user's loop, and estimated on
    fake tensors (GradScaler's own kernels, without its .item()) for the CPU: the same peaks."""
    from memfit.profiler.estimate import estimate

    measured = check_step(tiny_gpt, "adamw", 2, "amp-fp16", 1.0)
    step = memfit.TrainStep(accumulate=2, precision="amp-fp16", clip_grad_norm=1.0)
    estimated = estimate(tiny_gpt, target="cpu", step=step)
    for policies in _plans(measured.unit_names).values():
        want = memfit.predict(measured, policies).peak_bytes
        assert abs(memfit.predict(estimated, policies).peak_bytes - want) <= 0.01 * want


def test_accumulation_keeps_gradients_through_later_micro_batches():
    """A later micro-batch starts with every gradient alive and accumulates into it: its
    backward ends lower than the first one's by the unit's gradients; the step's peak is the
    later micro-batch's when activations outweigh nothing else."""
    model, batch = tiny_gpt()
    # three rounds each: a single round's step time swung 3.6x on a machine running two suites
    one = memfit.profile(model, batch, repeat=3)
    three = memfit.profile(model, batch, step=memfit.TrainStep(accumulate=3), repeat=3)
    for u in three.units:
        none = u.options[KEEP]
        assert none.bwd_end_bytes - none.later_bwd_end_bytes == u.param_bytes
    assert [p.later for p in three.phases if p.kind == "backward"].count(True) == len(three.units)
    assert memfit.predict(three, {}).peak_bytes > memfit.predict(one, {}).peak_bytes
    assert three.step_s > one.step_s  # three micro-batches' time (two measured, the third like the second)


def test_validate_runs_the_planned_step(tmp_path):
    model, batch = tiny_gpt()
    step = memfit.TrainStep("sgd-momentum", accumulate=2, precision="amp-bf16", clip_grad_norm=0.5)
    prof = memfit.profile(model, batch, step=step, repeat=1)
    sched = memfit.plan(prof, (memfit.predict(prof, {}).peak_bytes + prof.measured_peak_bytes[FULL]) // 2)
    sched.save(tmp_path / "s.json")
    loaded = memfit.load_schedule(tmp_path / "s.json")
    assert loaded.train_step == memfit.TrainStep("sgd-momentum", 2, "amp-bf16", 0.5)
    result = memfit.validate(model, batch, loaded, steps=0)
    assert result.ok and result.measured_peak_bytes == result.predicted_peak_bytes
    with pytest.raises(ScheduleMismatchError, match="2 micro-batches"):
        memfit.validate(model, batch, loaded, step=memfit.TrainStep("sgd-momentum", precision="amp-bf16",
                                                                     clip_grad_norm=0.5), steps=0)


def test_profiles_with_later_runs_round_trip(tmp_path):
    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, step=memfit.TrainStep(accumulate=2, precision="amp-bf16"), repeat=1)
    assert any(p.releases for p in prof.phases) and any(u.options[FULL].release_bytes > 0 for u in prof.units)
    prof.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    full = dict.fromkeys(prof.unit_names, FULL)
    assert memfit.predict(again, full) == memfit.predict(prof, full)
    plain = memfit.profile(model, batch, repeat=1).to_dict()
    assert "step" in plain and not any("later" in p or "releases" in p for p in plain["phases"])
    del plain["step"]  # a profile from before the step record: the plain step
    assert profile_from_dict(plain).train_step == memfit.TrainStep()


def test_step_mistakes_are_refused_in_words():
    model, batch = tiny_gpt()
    with pytest.raises(MemfitError, match="micro-batches >= 1"):
        memfit.TrainStep(accumulate=0)
    with pytest.raises(MemfitError, match="unknown optimizer 'lion'"):
        memfit.TrainStep("lion")
    with pytest.raises(MemfitError, match="positive number"):
        memfit.TrainStep(clip_grad_norm=-1.0)
    with pytest.raises(MemfitError, match="parameters are float32: convert the model"):
        memfit.profile(model, batch, step=memfit.TrainStep(precision="bf16"), repeat=1)
    with pytest.raises(MemfitError, match="give the optimizer once"):
        memfit.profile(model, batch, step=memfit.TrainStep(), optimizer="sgd", repeat=1)


def test_autocast_without_its_cache_is_planned_as_it_runs(tmp_path):
    """Lightning's mixed precision runs autocast(cache_enabled=False): no weight casts held to the
    forward's end. Planned with TrainStep(autocast_cache=False), the loop's peak is the
    prediction; planned with the cache, the same plan predicts what this loop does not reach."""
    model, batch = tiny_gpt()
    step = memfit.TrainStep(precision="amp-bf16", autocast_cache=False)
    prof = memfit.profile(model, batch, step=step, repeat=1)
    cached = memfit.profile(model, batch, step=memfit.TrainStep(precision="amp-bf16"), repeat=1)
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    sched = memfit.plan(prof, (lo + hi) // 2)
    assert sched.train_step.autocast_cache is False and "without its weight-cast cache" in step.describe()
    sched.save(tmp_path / "s.json")
    assert memfit.load_schedule(tmp_path / "s.json").train_step == sched.train_step
    loop = UserLoop(_apply(copy.deepcopy(model), sched.policies), batch, "adamw", 1, "amp-bf16", None)
    loop.autocast_cache = False
    loop.model.train()
    loop.step()
    measured = loop.peak()
    assert abs(measured - sched.predicted_peak_bytes) <= 64, (measured, sched.predicted_peak_bytes)  # 8 here
    assert memfit.predict(cached, sched.policies).peak_bytes - measured > 0.02 * measured  # 3% over, planned so
    with pytest.raises(MemfitError, match="autocast_cache=False is a setting of autocast"):
        memfit.TrainStep(autocast_cache=False)
