"""Errors a user can cause (``MemfitError``: the CLI prints them without a traceback and exits
2), and ``InternalError``, a broken invariant of memfit's own, which the CLI shows whole."""

from __future__ import annotations

from collections.abc import Callable


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


class PolicyError(MemfitError, ValueError):
    """A string that is no policy (memfit/policy.py); callers say where it came from and what to do."""


class PlanOptionError(MemfitError):
    """A planning setting out of range; ``spelled`` says it again with the setting's name (the
    command line's flag, or the API's keyword)."""

    def __init__(self, setting: str, template: str) -> None:
        self.setting, self.template = setting, template
        super().__init__(template.format(name=setting))

    def spelled(self, spell: Callable[[str], str]) -> MemfitError:
        return MemfitError(self.template.format(name=spell(self.setting)))


class MemfitWarning(UserWarning):
    """Something memfit noticed that makes the step differ from its plan."""


class EagerPlanCompiledWarning(MemfitWarning):
    """A model scheduled with a plan for the eager step runs under ``torch.compile``, whose
    partitioner saves other tensors: plan the compiled step (``memfit plan --compile``)."""


class CacheWarning(MemfitWarning):
    """A cache entry memfit could not trust: it profiles again and overwrites it."""


class NoisyTimesWarning(MemfitWarning):
    """Units of one structure ran at clearly different speeds in the plain step: the machine was
    busy, and the profile's times are less sure than its uncertainties say."""


class PlanDriftWarning(MemfitWarning):
    """A scheduled model runs on inputs of other shapes or dtypes than its plan was made for:
    its activations, and so its peak, are not the planned ones."""
