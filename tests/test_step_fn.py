"""A step function of the user's own (``memfit.profile(model, inputs, step_fn=fn)``): here a
contrastive step, two forwards of two views before one backward, with the user's optimizer in
its closure. The plan's predicted peak equals the peak of the user's function measured outside
memfit's harness, ``validate`` runs the function and agrees, and profiling leaves the weights and
the optimizer's state as they were."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.errors import MemfitError
from memfit.measure.memory import measured
from memfit.policy import FULL, KEEP


class Encoder(nn.Module):
    """Pre-LN transformer blocks over float inputs, mean-pooled: a SimCLR-style encoder."""

    def __init__(self, d: int = 48, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.1, batch_first=True, norm_first=True) for _ in range(n))
        self.head = nn.Linear(d, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def contrastive(model: nn.Module, opt: torch.optim.Optimizer):
    def step(m: nn.Module, views: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        a, b = F.normalize(m(views[0]), dim=1), F.normalize(m(views[1]), dim=1)
        logits = a @ b.T / 0.1
        loss = F.cross_entropy(logits, torch.arange(len(a)))
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def measured_peak(model: nn.Module, views, opt, fn) -> int:
    """The user's function's steady-state peak: what lives across steps, counted here (the
    gradients too, which the function frees when it zeroes them), plus the highest rise the meter
    sees while it runs."""
    def static():
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return [*model.parameters(), *model.buffers(), *state, *(p.grad for p in model.parameters()), *views]
    return measured(lambda: fn(model, views), static)[1]


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = Encoder()
    views = (torch.randn(8, 24, 12), torch.randn(8, 24, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, views, opt


def test_a_contrastive_step_is_planned_and_validated(setup):
    model, views, opt = setup
    fn = contrastive(model, opt)
    model.train()
    fn(model, views)  # the user's optimizer has its state, as in a running loop
    before = [p.detach().clone() for p in model.parameters()]
    saved = copy.deepcopy(opt.state_dict())
    prof = memfit.profile(model, views, step_fn=fn, repeat=1)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert str(opt.state_dict()) == str(saved)  # its state put back too
    assert prof.optimizer == "custom:AdamW" and prof.step["function"].endswith("contrastive.<locals>.step")
    forwards = [p for p in prof.phases if p.kind == "forward"]
    assert len(forwards) == 2 * len(prof.units)  # two runs of each unit per step
    none, full = prof.measured_peak_bytes[KEEP], prof.measured_peak_bytes[FULL]
    budget = (none + full) // 2
    sched = memfit.plan(prof, budget)
    # some units, not necessarily fewer than all: one round's costs can come out 0 on a busy
    # machine (clipped noise), and then checkpointing every unit ties with fewer
    assert sched.checkpointed and memfit.predict(prof, sched.policies).peak_bytes <= budget
    for policies in ({}, dict.fromkeys(prof.unit_names, FULL), sched.policies):
        twin = copy.deepcopy(model)
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
        twin_opt.load_state_dict(opt.state_dict())
        if policies:
            memfit.apply(twin, memfit.Schedule(policies, 1, 0, 0.0, 0.0, "t", "n", "n", 0.0,
                                               memfit.formats.schedule.model_fingerprint(twin, list(policies))))
        step = contrastive(twin, twin_opt)
        twin.train()
        step(twin, views)
        predicted = memfit.predict(prof, policies).peak_bytes
        measured = measured_peak(twin, views, twin_opt, step)
        assert abs(predicted - measured) <= 0.01 * measured, (policies, predicted, measured)
    with pytest.raises(MemfitError, match="step function"):
        memfit.validate(model, views, sched, steps=0)  # the schedule cannot rebuild the function
    result = memfit.validate(model, views, sched, step_fn=fn, steps=0)
    assert result.ok, result
    assert abs(result.measured_peak_bytes - result.predicted_peak_bytes) <= 0.01 * result.measured_peak_bytes


def test_step_fn_and_step_are_not_both_given(setup):
    model, views, opt = setup
    with pytest.raises(MemfitError, match="step_fn"):
        memfit.profile(model, views, step_fn=contrastive(model, opt), step=memfit.TrainStep(), repeat=1)
