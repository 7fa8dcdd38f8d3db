"""Timing whole training steps the way a training loop runs them."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from memfit.profiler.step import Inputs, LossFn, default_loss, device_of, make_optimizer, training_step, zero_grad
from memfit.runtime.apply import clear_policies, set_policies

T = TypeVar("T")


def alternate(run: Callable[[int], T], n: int, steps: int) -> list[list[T]]:
    """Results of ``run(0)`` … ``run(n - 1)`` over ``steps`` rounds.

    Within a round each configuration runs twice in a row and only the second step counts: a
    training loop runs one configuration step after step, and a step that follows another
    configuration's was measured 3-6% slower (the allocator and caches hold the other's
    layout), more so for the plain step, so mixed neighbours understate the slowdown. The order
    reverses every round (0 1 2, 2 1 0, …) so that drift in the machine's speed, which swings a
    step by ±10% over seconds, falls on every configuration alike; only ratios within a round
    are steady."""
    out: list[list[T]] = [[] for _ in range(n)]
    for i in range(steps):
        for k in range(n) if i % 2 == 0 else reversed(range(n)):
            run(k)  # settles the allocator and caches into this configuration
            out[k].append(_without_gc(run, k))
    return out


def _without_gc(run: Callable[[int], T], k: int) -> T:
    """``run(k)`` with Python's cyclic garbage collector held off, as ``timeit`` does: its full
    collections come every so many allocations, so in a fixed order of steps they land on the
    same configuration round after round and bias its time."""
    gc.collect()
    gc.disable()
    try:
        return run(k)
    finally:
        gc.enable()


def median_ratio(plain: list[float], other: list[float]) -> float:
    """Median over rounds of other / plain."""
    return statistics.median(b / a for a, b in zip(plain, other, strict=True))


def step_times(
    model: nn.Module, inputs: Any, schedules: list[dict[str, str]], *, loss_fn: LossFn | None = None,
    optimizer: str | None = "adamw", steps: int = 5,
) -> tuple[float, list[float]]:
    """Median step time of the plain model, and the median ratio of each schedule's step time to
    the plain step's in the same round (see ``alternate``): timing several schedules in one
    series lets them share the plain steps and the machine's drift."""
    inp = Inputs.of(inputs)
    loss = loss_fn or default_loss
    device = device_of(model)
    opt = make_optimizer(optimizer, model.parameters())
    model.train()
    configs = [{}, *schedules]

    def timed(k: int) -> float:
        set_policies(model, configs[k])
        try:
            zero_grad(model, opt)
            sync(device)
            t0 = time.perf_counter()
            training_step(model, inp, loss, opt)
            sync(device)
            return time.perf_counter() - t0
        finally:
            clear_policies(model)

    plain, *others = alternate(timed, len(configs), steps)
    return statistics.median(plain), [median_ratio(plain, t) for t in others]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
