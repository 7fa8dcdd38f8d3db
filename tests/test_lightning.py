"""memfit.integrations.lightning.MemfitCallback in Lightning's own Trainer: a small LightningModule around
memfit's zoo GPT whose training_step computes its own cross-entropy, 3 optimizer steps of 2
accumulated batches with clipping, fp32 and bf16-mixed, against the same Trainer without memfit."""

import copy
import logging

import pytest
import torch
from torch.nn import functional as F

import memfit

L = pytest.importorskip("lightning.pytorch")
import memfit.integrations.lightning  # noqa: E402
from memfit.zoo import gpt  # noqa: E402


class _LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=4, seed=0)[0]
        self.losses: list[float] = []

    def forward(self, idx):
        return self.net(idx)["logits"]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())  # the loop's batches only, not memfit's profiling

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _data():
    x = torch.randint(0, 256, (48, 32), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=4, shuffle=True)


def _train(base, callback=None, precision="32-true"):
    module = copy.deepcopy(base)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=1.0, precision=precision,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback] if callback else [])
    trainer.fit(module, _data())
    return module


@pytest.fixture(scope="module")
def base():
    return _LM()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_callback_trains_as_the_trainer_without_it_within_the_budget(base, caplog, precision):
    plain = _train(base, precision=precision)
    callback = memfit.integrations.lightning.MemfitCallback(5 * 2**20, cache_dir=False, repeat=1)
    with caplog.at_level(logging.INFO, logger="memfit"):
        module = _train(base, callback, precision)
    sched = callback.schedule
    assert 0 < len(sched.checkpointed) < 4, sched.policies
    step = sched.train_step
    assert (step.accumulate, step.precision, step.clip_grad_norm, step.optimizer_name) == (
        2, "amp-bf16" if precision == "bf16-mixed" else "fp32", 1.0, "adamw")
    assert module.losses == plain.losses and len(module.losses) == 6  # 3 steps of 2 batches
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), module.parameters(), strict=True))
    measured, predicted = callback.measured_peak_bytes, sched.predicted_peak_bytes
    # Lightning's own few tensors (its loss record) beside the planned step: 2 KiB here
    assert measured <= sched.budget_bytes and abs(measured - predicted) <= 4096, (measured, predicted)
    assert step.autocast_cache == (precision == "32-true")  # bf16-mixed: autocast(cache_enabled=False)
    said = [r.getMessage() for r in caplog.records if r.name == "memfit"]
    assert any(s.startswith("memfit: measured peak") and "within the budget" in s for s in said), said


def test_no_drift_warning_for_the_forward_training_step_calls(base, recwarn):
    _train(base, memfit.integrations.lightning.MemfitCallback(5 * 2**20, cache_dir=False, repeat=1))
    assert not [w for w in recwarn if issubclass(w.category, memfit.PlanDriftWarning)]
