"""The compiler's own activation memory budget as a compiled plan.

AOTAutograd's partitioner can itself recompute activations to stay under a fraction of what it
could keep (``activation_memory_budget``), across the whole step: the embeddings and the head
too, which a checkpoint inside the blocks cannot reach. Where that is faster at a budget than
memfit's options, memfit's compiled plan is the compiler's own, and says so: compiled planning
(steps/compiled.py) finds the largest such budget whose compiled step fits, checks that its
gradients are the plain compiled step's (they are not where the partitioner recomputes a dropout
with a fresh mask, PyTorch issue #190758), and times it beside its own plans. Here too: the
backend a compiled plan is compiled and validated under (``check_backend``, ``with_backend``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from memfit.errors import MemfitError
from memfit.formats.schedule import Schedule
from memfit.torch_private import backend_by_name, partitioner_budget

STEP = 0.05  # the budgets tried are multiples of it, from STEP to 1 - STEP


def check_backend(backend: str) -> str:
    """``backend`` if ``torch.compile`` knows it, else a ``MemfitError`` naming the ones it knows."""
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        usual = sorted(b for b in known if "TESTING" not in b and not b.startswith("relu_"))  # not Dynamo's test ones
        raise MemfitError(f"unknown torch.compile backend {backend!r}; use one of {', '.join(usual)}")
    return backend


@functools.cache
def compiler(backend: str, memory_budget: float | None = None) -> str | Callable[..., Any]:
    """What ``torch.compile(backend=...)`` takes to compile with ``backend`` under the partitioner's
    ``memory_budget`` (0 to 1; None: its default, and ``backend`` itself). One object per pair:
    Dynamo guards on the backend, so copies compiled under other budgets do not share graphs."""
    if memory_budget is None:
        return backend
    if not 0.0 <= memory_budget <= 1.0:
        raise MemfitError(f"an activation memory budget is a fraction from 0 to 1; got {memory_budget}")
    inner = backend_by_name(backend)

    def under_budget(gm: Any, example_inputs: list[Any]) -> Any:
        with partitioner_budget(memory_budget):
            return inner(gm, example_inputs)

    under_budget.__name__ = f"{backend}_at_memory_budget_{memory_budget:g}"
    return under_budget


def compile_backend(schedule: Schedule) -> str | Callable[..., Any]:
    """The ``backend`` to give ``torch.compile`` for a plan made for the compiled step
    (``plan_compiled``, ``memfit plan --compile``): the backend it was planned for, under the
    partitioner's memory budget where the plan records one.

        model = memfit.apply(model, schedule)
        model = torch.compile(model, backend=memfit.compile_backend(schedule))
    """
    if schedule.compile is None:
        raise MemfitError("this schedule was planned for the eager step, not a compiled one: compile it with the "
                          "backend of your choice, or plan again with --compile BACKEND (plan_compiled)")
    return compiler(schedule.compile["backend"], schedule.compile.get("memory_budget"))


def budgets() -> list[float]:
    """The budgets tried, smallest first."""
    return [round(k * STEP, 2) for k in range(1, round(1 / STEP))]


def largest_fitting(peak_at: Callable[[float], int], target: int) -> tuple[float, int] | None:
    """A budget of ``budgets()`` whose measured peak (``peak_at``) is at most ``target``, and that
    peak, by bisection for the largest: log2(19), five compilations, not nineteen. The partitioner
    budgets by its own estimate of what it keeps, so the measured peak is not monotone in the
    budget (on a 4-block GPT with dropout, 0.3 peaked above 0.7): the budget found fits, measured,
    and may not be the largest that does. None where none of those measured fits."""
    grid, found = budgets(), None
    lo, hi = 0, len(grid) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        peak = peak_at(grid[mid])
        if peak <= target:
            found, lo = (grid[mid], peak), mid + 1
        else:
            hi = mid - 1
    return found


def with_backend(schedule: Schedule, backend: str | None) -> tuple[str | None, float | None, int]:
    """The backend to validate ``schedule`` under (``backend``, else the one it was planned for),
    the partitioner's memory budget its plan records (None: none, or not compiled) and the peak
    to compare with: the compiled step's measured at planning for that backend, else the eager
    prediction."""
    planned = schedule.compile["backend"] if schedule.compile else None
    chosen = backend if backend is not None else planned
    if chosen is not None:
        check_backend(chosen)
    memory_budget = schedule.compile.get("memory_budget") if schedule.compile and chosen is not None else None
    peak = schedule.compile["peak_bytes"] if chosen is not None and chosen == planned else schedule.predicted_peak_bytes
    return chosen, memory_budget, peak
