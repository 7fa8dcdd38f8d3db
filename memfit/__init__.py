"""memfit: plan activation checkpointing so a PyTorch training step fits a memory budget.

    prof = memfit.profile(model, inputs)              # measure (CUDA or CPU)
    sched = memfit.plan(prof, "24GB")                 # solve the integer program
    model = memfit.apply(model, sched)                # checkpoint the chosen units in place
"""

__version__ = "0.1.0"

from memfit.budget import format_bytes, parse_bytes
from memfit.errors import (
    BudgetFormatError,
    FileFormatError,
    InfeasibleBudgetError,
    MemfitError,
    ScheduleMismatchError,
    UnitSelectionError,
)
from memfit.optimizer.model import Prediction, predict
from memfit.optimizer.planner import min_budget_bytes, plan
from memfit.profile import Profile
from memfit.profiler import profile
from memfit.profiler.step import default_loss
from memfit.runtime.apply import apply
from memfit.runtime.memory import keep_freed_cpu_memory
from memfit.runtime.validate import Validation, validate
from memfit.schedule import Schedule, load_schedule

__all__ = [
    "BudgetFormatError",
    "FileFormatError",
    "InfeasibleBudgetError",
    "MemfitError",
    "Prediction",
    "Profile",
    "Schedule",
    "ScheduleMismatchError",
    "UnitSelectionError",
    "Validation",
    "apply",
    "default_loss",
    "format_bytes",
    "keep_freed_cpu_memory",
    "load_schedule",
    "min_budget_bytes",
    "parse_bytes",
    "plan",
    "predict",
    "profile",
    "validate",
]
