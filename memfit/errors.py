"""Errors a user can cause (``MemfitError``: the CLI prints them without a traceback and exits
2), and ``InternalError``, a broken invariant of memfit's own, which the CLI shows whole."""

from __future__ import annotations


class MemfitError(Exception):
    """Base class: something the user can fix; the message says how."""


class BudgetFormatError(MemfitError):
    """A memory budget string that cannot be parsed."""


class InfeasibleBudgetError(MemfitError):
    """No schedule fits the budget; ``min_budget_bytes`` is the smallest that does."""

    def __init__(self, message: str, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class FileFormatError(MemfitError):
    """A profile or schedule file that is missing, corrupt or of the wrong format."""


class ScheduleMismatchError(MemfitError):
    """A schedule that was made for another model (fingerprint or unit names differ)."""


class SolverTimeout(MemfitError):
    """The time limit passed before the solver found any answer."""


class InternalError(Exception):
    """A bug in memfit: an invariant does not hold. Not a ``MemfitError``: there is nothing for
    the user to fix, so the CLI shows the traceback and asks for a report."""


class UnitSelectionError(MemfitError):
    """Units that cannot be found or do not form a chain."""


class MemfitWarning(UserWarning):
    """Something memfit noticed that makes the step differ from its plan."""


class EagerPlanCompiledWarning(MemfitWarning):
    """A model scheduled with a plan for the eager step runs under ``torch.compile``, whose
    partitioner saves other tensors: plan the compiled step (``memfit plan --compile``)."""


class PlanDriftWarning(MemfitWarning):
    """A scheduled model runs on inputs of other shapes or dtypes than its plan was made for:
    its activations, and so its peak, are not the planned ones."""
