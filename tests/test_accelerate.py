"""The accelerate recipe (README): memfit.fit with memfit.integrations.trainers.accelerate_step in a loop
written as accelerate's docs write it (prepare, accumulate, backward, clip_grad_norm_), 3
optimizer steps of 2 micro-batches under bf16 autocast, against the same loop without memfit."""

import copy

import pytest
import torch

import memfit
from memfit.integrations import trainers

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _run(base, with_memfit: bool):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a fresh Accelerator per run, as a new script would have
    GradientState._reset_state()
    accelerate.utils.set_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randint(0, 256, (24, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in x], batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sched = None
    if with_memfit:
        sched = memfit.fit(accelerator.unwrap_model(model), trainers.first_batch(loader), 6 * 2**20,
                           step=trainers.accelerate_step(accelerator, optimizer, clip_grad_norm=1.0),
                           cache_dir=False, repeat=1)
    losses, peaks = [], []
    meter = trainers.StepPeak()
    model.train()
    for i, batch in enumerate(loader):
        if i % 2 == 0:
            meter.start(model, optimizer, batch)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if i % 2 == 1:
            peaks.append(meter.stop())
        if i == 5:
            break
    return sched, losses, peaks, model


def test_the_accelerate_recipe_trains_as_the_loop_without_memfit_within_the_budget():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256,
                                                                n_positions=64))
    _, plain_losses, _, plain = _run(base, False)
    sched, losses, peaks, model = _run(base, True)
    step = sched.train_step
    assert (step.accumulate, step.precision, step.clip_grad_norm) == (2, "amp-bf16", 1.0)
    assert 0 < len(sched.checkpointed) < 4
    assert losses == plain_losses and len(losses) == 6
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    steady, predicted = max(peaks[1:]), sched.predicted_peak_bytes  # the first step makes AdamW's state
    assert steady <= sched.budget_bytes and abs(steady - predicted) <= 4096, (peaks, predicted)  # 4 bytes here
    said = trainers.report(predicted, steady, sched.budget_bytes)  # the README recipe's last line
    assert said.startswith("memfit: measured peak") and said.endswith("within the budget")
