"""The step harness: training steps of a model from a fixed seed, with its peak measured, for
validate, compiled planning, the ranks, the benchmarks and the tests (issue 22 gathers the rest of
the step's set-up here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.measure.memory import memory_recorder
from memfit.measure.step import (
    Inputs,
    LossFn,
    default_loss,
    device_of,
    make_optimizer,
    static_bytes,
    training_step,
    zero_grad,
)


@dataclass(slots=True)
class StepRun:
    """What one configuration did: losses per step, final gradients and buffers, peak, time."""

    losses: list[float]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    peak_bytes: int


def measure_steps(
    model: nn.Module, inputs: Any, *, loss_fn: LossFn | None = None, optimizer: str | None = "adamw",
    steps: int = 2, seed: int = 0, compile: str | Callable[..., Any] | None = None,
) -> StepRun:
    """Run ``steps`` training steps (the first warms up, and compiles under ``compile``, a
    ``torch.compile`` backend, by name or as a callable) from a fixed seed; the peak is the last
    step's. The optimizer has learning rate 0, so every step sees the same weights."""
    inp = Inputs.of(inputs)
    runner = model if compile is None else torch.compile(model, backend=compile)
    loss = loss_fn or default_loss
    device = device_of(model)
    opt = make_optimizer(optimizer, model.parameters())
    model.train()
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps - 1):
        zero_grad(model, opt)
        losses.append(training_step(runner, inp, loss, opt))
    zero_grad(model, opt)
    baseline = static_bytes(model, opt, inp)
    recorder = memory_recorder(device)
    with recorder:
        recorder.on_mark("start")
        losses.append(training_step(runner, inp, loss, opt))
        recorder.on_mark("end")
    marks = recorder.marks()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return StepRun(losses, grads, buffers, baseline + max(m.peak for m in marks) - marks[0].level)
