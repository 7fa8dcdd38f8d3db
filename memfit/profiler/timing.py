"""Timing whole training steps the way a training loop runs them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from memfit.profiler.step import Inputs, LossFn, default_loss, device_of, make_optimizer, training_step, zero_grad
from memfit.runtime.apply import clear_policies, set_policies

T = TypeVar("T")


def alternate(run: Callable[[bool], T], steps: int) -> tuple[list[T], list[T]]:
    """Results of ``run(False)`` and ``run(True)`` over ``steps`` rounds in alternation (ABBA
    order), after one warm-up round that is left out. On a shared machine one step's time swings
    by ±10%, and drift falls on adjacent steps alike, so only their ratio is steady."""
    out: dict[bool, list[T]] = {False: [], True: []}
    for i in range(steps + 1):
        for flag in (False, True) if i % 2 == 0 else (True, False):
            result = run(flag)
            if i > 0:
                out[flag].append(result)
    return out[False], out[True]


def median_ratio(plain: list[float], other: list[float]) -> float:
    """Median over adjacent pairs of other / plain."""
    return statistics.median(b / a for a, b in zip(plain, other, strict=True))


def step_times(
    model: nn.Module, inputs: Any, policies: dict[str, str], *, loss_fn: LossFn | None = None,
    optimizer: str | None = "adamw", steps: int = 5,
) -> tuple[float, float, float]:
    """Median step time of the plain model and of the scheduled one, and the median ratio of
    scheduled to plain over adjacent pairs (see ``alternate``)."""
    inp = Inputs.of(inputs)
    loss = loss_fn or default_loss
    device = device_of(model)
    opt = make_optimizer(optimizer, model.parameters())
    model.train()

    def timed(scheduled: bool) -> float:
        if scheduled:
            set_policies(model, policies)
        try:
            zero_grad(model, opt)
            _sync(device)
            t0 = time.perf_counter()
            training_step(model, inp, loss, opt)
            _sync(device)
            return time.perf_counter() - t0
        finally:
            clear_policies(model)

    plain, sched = alternate(timed, steps)
    return statistics.median(plain), statistics.median(sched), median_ratio(plain, sched)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
