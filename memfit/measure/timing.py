"""Timing whole training steps the way a training loop runs them."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from memfit.measure.inputs import Inputs
from memfit.measure.memory import gc_held
from memfit.measure.step import LossFn, training_step

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
    with gc_held():
        return run(k)


def median_ratio(plain: list[float], other: list[float]) -> float:
    """Median over rounds of other / plain."""
    return statistics.median(b / a for a, b in zip(plain, other, strict=True))


MIN_TIMED_ROUNDS = 3  # fewer rounds say nothing about how much the ratio varies


def ratio_uncertainty(plain: list[float], other: list[float]) -> float:
    """How far ``median_ratio`` is sure: two standard errors of the median of other / plain over
    the rounds (1.253 σ/√n, σ from the interquartile range, robust to the odd round a neighbour's
    burst spoils), so that two measurements agree within the sum of theirs. NaN below
    ``MIN_TIMED_ROUNDS`` rounds."""
    if len(plain) < MIN_TIMED_ROUNDS:
        return float("nan")
    return _two_errors([b / a for a, b in zip(plain, other, strict=True)], len(plain))


def _two_errors(spread: list[float], rounds: int) -> float:
    """Two standard errors of a median over ``rounds`` (1.253 σ/√n), σ from the interquartile
    range of ``spread``."""
    return 2 * 1.2533 * iqr(spread) / 1.349 / math.sqrt(rounds)


def ratio_uncertainties(plain: list[float], others: list[list[float]]) -> list[float]:
    """``ratio_uncertainty`` of each of ``others`` against ``plain`` (one interleaved series),
    never below that of all of them pooled (each one's ratios about its own median). With a
    handful of rounds one interquartile range comes out narrow by chance (an option's recorded
    uncertainty 7 times below a second profile's of the same option, which then disagreed beyond
    both), while the machine's noise is common to every configuration of one series."""
    if len(plain) < MIN_TIMED_ROUNDS or not others:
        return [float("nan")] * len(others)
    deviations: list[float] = []
    own: list[float] = []
    for other in others:
        ratios = [b / a for a, b in zip(plain, other, strict=True)]
        mid = statistics.median(ratios)
        deviations += [r - mid for r in ratios]
        own.append(_two_errors(ratios, len(plain)))
    pooled = _two_errors(deviations, len(plain))
    return [max(u, pooled) for u in own]


def iqr(xs: list[float]) -> float:
    """The interquartile range (inclusive quartiles: defined from 2 samples on)."""
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The clock a step is timed with: on a CPU running one thread, that thread's CPU time
    (``time.thread_time``: a step on a shared machine then scatters about half as much as by the
    wall, since time the thread waits for a core is not counted; a CPU backward runs on the
    calling thread); else the wall clock (several threads, or a GPU, synchronised around it)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def timed_step(runner: Any, inputs: Inputs, loss_fn: LossFn, state: Any, device: torch.device) -> float:
    """Seconds of one training step of ``runner`` (``state``'s model itself, or it compiled),
    from the loop's ``zero_grad``, with CUDA synchronised on both sides, by ``clock``."""
    now = clock(device)
    state.zero_grad()
    sync(device)
    t0 = now()
    training_step(runner, inputs, loss_fn, state)
    sync(device)
    return now() - t0
