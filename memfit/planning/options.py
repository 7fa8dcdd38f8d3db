"""How to plan, as one record: ``plan``, ``sweep``, ``fit`` and the command line each make one
``PlanOptions`` at their border (from ``options=``, keywords, or flags), it checks itself once, when
it is made, and that record is what they carry inside. A mistake names the setting as its maker
spells it (``max_segment`` in Python, ``--max-segment`` on the command line)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from memfit.errors import MemfitError, PlanOptionError
from memfit.planning import SOLVERS, STRATEGY_NAMES

GRANULARITIES = ("module", "fine")
MAX_FALLBACKS = 20


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """``strategy``: ``ilp`` (the optimum, by ``solver``) or a baseline's name; ``segments`` of up
    to ``max_segment`` units where the units form a chain; ``granularity="fine"``: the finer
    options of a fine profile too; ``time_limit`` seconds for the solver; ``fallbacks`` tighter
    plans stored for ``memfit.tighten``."""

    strategy: str = "ilp"
    solver: str = "cpsat"
    segments: bool = True
    max_segment: int = 8
    granularity: str = "module"
    time_limit: float | None = None
    fallbacks: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise PlanOptionError("strategy", f"unknown {{name}} {self.strategy!r}; use one of "
                                              f"{', '.join(STRATEGY_NAMES)}")
        if self.solver not in SOLVERS:
            raise PlanOptionError("solver", f"unknown {{name}} {self.solver!r}; use one of {', '.join(SOLVERS)}")
        if self.max_segment < 2:
            raise PlanOptionError("max_segment", "{name} must be at least 2 (units in one checkpointed run), got "
                                                 f"{self.max_segment}")
        if self.granularity not in GRANULARITIES:
            raise PlanOptionError("granularity", f"unknown {{name}} {self.granularity!r}; use module or fine")
        if not 0 <= self.fallbacks <= MAX_FALLBACKS:
            raise PlanOptionError("fallbacks", f"{{name}} is a count of tighter plans from 0 to {MAX_FALLBACKS}, "
                                               f"got {self.fallbacks}")
        if self.time_limit is not None and not (math.isfinite(self.time_limit) and self.time_limit > 0):
            raise PlanOptionError("time_limit", "{name} must be a positive number of seconds, got "
                                                f"{self.time_limit}")


def check_strategies(strategies: Sequence[str], name: str = "strategies") -> list[str]:
    """Each strategy once, in order; a MemfitError naming the unknown ones."""
    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown or not strategies:
        raise MemfitError(f"{name}: unknown {', '.join(unknown) or '(none given)'}; use some of "
                          f"{', '.join(STRATEGY_NAMES)}")
    return list(dict.fromkeys(strategies))


SETTINGS = tuple(f.name for f in fields(PlanOptions))


def settle(options: PlanOptions | None = None, **given: Any) -> PlanOptions:
    """The planning settings as one record: ``options`` (or the defaults) with the settings given as
    keywords put in (``None``: not given). A name that is no setting is a MemfitError naming them."""
    unknown = [k for k in given if k not in SETTINGS]
    if unknown:
        raise MemfitError(f"unknown planning setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                          f"the settings (memfit.PlanOptions) are {', '.join(SETTINGS)}")
    if options is not None and not isinstance(options, PlanOptions):
        raise MemfitError(f"options must be a memfit.PlanOptions, got {type(options).__name__}")
    changed = {k: v for k, v in given.items() if v is not None}
    base = options if options is not None else PlanOptions()
    return replace(base, **changed) if changed else base
