"""memfit.hf.MemfitCallback in Hugging Face's own Trainer: HF GPT-2 built from a config with its
defaults, 3 optimizer steps of 2 accumulated micro-batches, with and without bf16 autocast,
against the same Trainer run without memfit."""

import copy
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memfit

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import memfit.hf  # noqa: E402

BUDGET = 6 * 2**20


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        self.x = torch.randint(0, 256, (n, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


@pytest.fixture(scope="module")
def gpt2():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    return transformers.GPT2LMHeadModel(config)  # use_cache=True, dropout 0.1: the config's defaults


def _train(base, tmp_path, callback=None, **settings):
    model = copy.deepcopy(base)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=0.01, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True, **settings)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(), eval_dataset=_Rows(8),
                                   callbacks=[callback] if callback else [])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, model, losses


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "amp-bf16"])
def test_the_callback_trains_as_the_trainer_without_it_within_the_budget(gpt2, tmp_path, caplog, bf16):
    _, plain, plain_losses = _train(gpt2, tmp_path, bf16=bf16)
    callback = memfit.hf.MemfitCallback(BUDGET, cache_dir=False, repeat=1)
    with caplog.at_level(logging.INFO, logger="memfit"):
        trainer, model, losses = _train(gpt2, tmp_path, callback, bf16=bf16)
    sched = callback.schedule
    assert 0 < len(sched.checkpointed) < 4, sched.policies
    step = sched.train_step
    fused = trainer.optimizer.optimizer.defaults["fused"]  # HF 5's default optim is adamw_torch_fused
    assert (step.accumulate, step.precision, step.clip_grad_norm, step.optimizer_name) == (
        2, "amp-bf16" if bf16 else "fp32", 1.0, "adamw-fused" if fused else "adamw")  # the Trainer's own
    assert losses == plain_losses and len(losses) == 3
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    measured = callback.measured_peak_bytes
    predicted = sched.predicted_peak_bytes
    assert measured <= BUDGET and abs(measured - predicted) <= 64, (measured, predicted)
    said = [r.getMessage() for r in caplog.records if r.name == "memfit"]
    assert any(s.startswith("memfit: checkpointing") for s in said)
    assert any(s.startswith("memfit: measured peak") and "within the budget" in s for s in said), said
    logged = [h for h in trainer.state.log_history if "memfit/measured_peak_mib" in h]
    assert len(logged) == 1 and logged[0]["memfit/measured_peak_mib"] == round(measured / 2**20, 2)


def test_with_hugging_face_checkpointing_on_the_callback_turns_it_off_and_says_so(gpt2, tmp_path):
    _, plain, plain_losses = _train(gpt2, tmp_path)
    callback = memfit.hf.MemfitCallback(BUDGET, cache_dir=False, repeat=1)
    with pytest.warns(memfit.MemfitWarning, match="turned Hugging Face's gradient checkpointing off"):
        _, model, losses = _train(gpt2, tmp_path, callback, gradient_checkpointing=True)
    assert not model.is_gradient_checkpointing
    assert 0 < len(callback.schedule.checkpointed) < 4
    assert losses == plain_losses
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters(), strict=True))


class _CountMatmuls(TorchDispatchMode):
    """Counts addmm calls (GPT-2's four Conv1D layers per block): a recomputed block repeats them."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


def test_evaluation_and_generate_between_steps_run_as_the_plain_model_without_recompute(gpt2, tmp_path):
    plain_trainer, plain, _ = _train(gpt2, tmp_path)
    callback = memfit.hf.MemfitCallback(BUDGET, cache_dir=False, repeat=1)
    trainer, model, _ = _train(gpt2, tmp_path, callback)
    counts = []
    for t in (plain_trainer, trainer):
        with _CountMatmuls() as mm:
            counts.append((t.evaluate()["eval_loss"], mm.n))
    assert counts[0] == counts[1]  # the same loss, and not one matmul more under no_grad
    ids = torch.randint(0, 256, (1, 8))
    out = [m.generate(ids, max_new_tokens=4, do_sample=False) for m in (plain, model)]
    assert out[0].shape == (1, 12) and torch.equal(out[0], out[1])
    model.train()
    loss = model(input_ids=ids, labels=ids).loss  # training again after them: the plan is still on
    with _CountMatmuls() as mm:
        loss.backward()
    assert mm.n == 4 * len(callback.schedule.checkpointed)  # each checkpointed block's forward, recomputed


def test_evaluation_between_steps_leaves_the_losses_and_the_measured_peak_alone(gpt2, tmp_path):
    """eval_strategy='steps' with eval_steps=1: an evaluation (no_grad) after every optimizer step."""
    settings = {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4}
    plain_trainer, _, plain_losses = _train(gpt2, tmp_path, **settings)
    callback = memfit.hf.MemfitCallback(BUDGET, cache_dir=False, repeat=1)
    trainer, _, losses = _train(gpt2, tmp_path, callback, **settings)
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (plain_trainer, trainer)]
    assert losses == plain_losses and evals[0] == evals[1] and len(evals[1]) == 3
    predicted = callback.schedule.predicted_peak_bytes
    assert abs(callback.measured_peak_bytes - predicted) <= 64 and callback.measured_peak_bytes <= BUDGET


class _Images(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def test_the_callback_on_a_resnet_with_batchnorm_trains_as_the_trainer_without_it(tmp_path):
    """Hugging Face's ResNet (BatchNorm, in-place residual adds), not a model memfit was shaped
    around: weights and BatchNorm statistics equal to the Trainer's without memfit, the measured
    step peak the prediction's. The budget lies between its least (4.13 MiB, weights and AdamW
    state dominate this small net) and its unplanned 4.24 MiB, with the tests' AVX2 oneDNN kernels
    (conftest.py; the default kernels here need 1 MiB less, and predict that as exactly)."""
    from .models import hf_resnet

    base = hf_resnet()[0]
    trained, callbacks = [], [None, memfit.hf.MemfitCallback(4_400_000, cache_dir=False, repeat=1)]
    for callback in callbacks:
        model = copy.deepcopy(base)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=3, learning_rate=0.05, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
            seed=0, disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=_Images(),
                             callbacks=[callback] if callback else []).train()
        trained.append(model)
    plain, model = trained
    sched = callbacks[1].schedule
    assert 0 < len(sched.checkpointed) < len(sched.policies), sched.policies
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    assert all(torch.equal(b, c) for b, c in zip(plain.buffers(), model.buffers(), strict=True))
    measured, predicted = callbacks[1].measured_peak_bytes, sched.predicted_peak_bytes
    assert measured <= sched.budget_bytes and abs(measured - predicted) <= 64, (measured, predicted)
