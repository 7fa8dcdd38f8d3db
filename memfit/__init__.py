"""memfit: plan activation checkpointing so a PyTorch training step fits a memory budget.

    memfit.fit(model, batch, "24GB")                  # all in one call, cached between runs

or step by step:

    prof = memfit.profile(model, inputs)              # measure (CUDA or CPU)
    sched = memfit.plan(prof, "24GB")                 # solve the integer program
    model = memfit.apply(model, sched)                # checkpoint the chosen units in place

Names are imported on first use, so that ``memfit --help`` answers at once and the command line
can take a Ctrl-C from its first instant (importing torch takes seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memfit.budget import format_bytes, parse_bytes
from memfit.errors import (
    BudgetFormatError,
    CacheWarning,
    EagerPlanCompiledWarning,
    FileFormatError,
    InfeasibleBudgetError,
    InternalError,
    MemfitError,
    MemfitWarning,
    NoisyTimesWarning,
    PlanDriftWarning,
    PlanOptionError,
    PolicyError,
    ScheduleMismatchError,
    SolverTimeout,
    UnitSelectionError,
)
from memfit.policy import Policy
from memfit.policy import parse as parse_policy
from memfit.trainstep import TrainStep

__version__ = "0.1.0"

_LAZY = {
    "Prediction": "memfit.planning.peak",
    "predict": "memfit.planning.peak",
    "min_budget_bytes": "memfit.planning.planner",
    "plan": "memfit.planning.planner",
    "PlanOptions": "memfit.planning.options",
    "plan_compiled": "memfit.steps.compiled",
    "compile_backend": "memfit.steps.compiled_budget",
    "Profile": "memfit.formats.profile",
    "profile": "memfit.profiler",
    "estimate": "memfit.profiler.estimate",
    "fit": "memfit.fitting",
    "default_loss": "memfit.measure.step",
    "apply": "memfit.runtime.apply",
    "remove": "memfit.runtime.apply",
    "tighten": "memfit.runtime.apply",
    "keep_freed_cpu_memory": "memfit.measure.malloc",
    "Validation": "memfit.steps.validate",
    "validate": "memfit.steps.validate",
    "sweep": "memfit.planning.sweep",
    "Schedule": "memfit.formats.schedule",
    "load_schedule": "memfit.formats.schedule",
    "profile_stages": "memfit.steps.stages",
    "estimate_stages": "memfit.steps.stages",
    "plan_stages": "memfit.steps.stages",
    "StagePlans": "memfit.steps.stages",
}

if TYPE_CHECKING:
    from memfit.fitting import fit
    from memfit.formats.profile import Profile
    from memfit.formats.schedule import Schedule, load_schedule
    from memfit.measure.malloc import keep_freed_cpu_memory
    from memfit.measure.step import default_loss
    from memfit.planning.options import PlanOptions
    from memfit.planning.peak import Prediction, predict
    from memfit.planning.planner import min_budget_bytes, plan
    from memfit.planning.sweep import sweep
    from memfit.profiler import profile
    from memfit.profiler.estimate import estimate
    from memfit.runtime.apply import apply, remove, tighten
    from memfit.steps.compiled import plan_compiled
    from memfit.steps.compiled_budget import compile_backend
    from memfit.steps.stages import StagePlans, estimate_stages, plan_stages, profile_stages
    from memfit.steps.validate import Validation, validate


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BudgetFormatError",
    "CacheWarning",
    "EagerPlanCompiledWarning",
    "FileFormatError",
    "InfeasibleBudgetError",
    "InternalError",
    "MemfitError",
    "MemfitWarning",
    "NoisyTimesWarning",
    "PlanDriftWarning",
    "PlanOptionError",
    "PlanOptions",
    "Policy",
    "PolicyError",
    "Prediction",
    "Profile",
    "Schedule",
    "ScheduleMismatchError",
    "SolverTimeout",
    "StagePlans",
    "TrainStep",
    "UnitSelectionError",
    "Validation",
    "apply",
    "compile_backend",
    "default_loss",
    "estimate",
    "estimate_stages",
    "fit",
    "format_bytes",
    "keep_freed_cpu_memory",
    "load_schedule",
    "min_budget_bytes",
    "parse_bytes",
    "parse_policy",
    "plan",
    "plan_compiled",
    "plan_stages",
    "predict",
    "profile",
    "profile_stages",
    "remove",
    "sweep",
    "tighten",
    "validate",
]
