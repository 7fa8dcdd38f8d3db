"""The schedules people choose without a planner, as named strategies.

``none`` and ``full``; ``every-k`` (every k-th unit, the cheapest k that fits); ``sqrt`` (Chen
et al. 2016: segments of about sqrt(N) units, each keeping only its input; needs a chain);
``first-k`` (Megatron's "block" method: the first k units recomputed, the smallest k that fits);
``greedy`` (most bytes saved per second of recompute first, until it fits). Each returns the
policies it would use for a budget, or None when it cannot fit it; ``not_applicable`` says why a
strategy has no schedule at all for a model (sqrt on units that are not a chain).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from memfit.formats.profile import Profile
from memfit.planning import BASELINE_NAMES
from memfit.planning.peak import Prediction, predict
from memfit.planning.roles import FULL, segment
from memfit.policy import FULL as CHECKPOINT
from memfit.policy import KEEP, Policy

Policies = dict[str, Policy]


@dataclass(frozen=True, slots=True)
class Baseline:
    """A strategy as the schedules it may use (independent of the budget) and how it picks one:
    ``cheapest``, the least recompute among those that fit, or ``first``, the first that fits."""

    candidates: Callable[[Profile], list[Policies]]
    pick: str


def pick(baseline: Baseline, predictions: list[Prediction], budget: int) -> int | None:
    """The index of the candidate ``baseline`` uses at ``budget``, given each candidate's prediction."""
    fitting = [k for k, p in enumerate(predictions) if p.peak_bytes <= budget]
    if not fitting:
        return None
    if baseline.pick == "first":
        return fitting[0]
    return min(fitting, key=lambda k: (predictions[k].recompute_s, k))


def _none(profile: Profile) -> list[Policies]:
    return [dict.fromkeys(profile.unit_names, KEEP)]


def _full(profile: Profile) -> list[Policies]:
    return [dict.fromkeys(profile.unit_names, CHECKPOINT)]


def _every_k(profile: Profile) -> list[Policies]:
    """k = 1, 2, ... N, and k = infinity (nothing checkpointed)."""
    names = profile.unit_names
    candidates = [
        {n: CHECKPOINT if (j + 1) % k == 0 else KEEP for j, n in enumerate(names)} for k in range(1, len(names) + 1)
    ]
    return [*candidates, dict.fromkeys(names, KEEP)]


def not_applicable(profile: Profile, strategy: str) -> str | None:
    """Why ``strategy`` has no schedule for this profile at any budget; None when it has."""
    if strategy == "sqrt" and not profile.chain:
        return ("sqrt(N) checkpoints runs of several units as one segment, which memfit offers only when the "
                "units form a chain (each unit's only input is the previous unit's output); these units do not")
    if strategy == "sqrt" and not profile.segmentable:
        return "sqrt(N) segments are not planned for steps under autocast (amp-*) yet"
    if strategy == "sqrt" and len(profile.units) < 2:
        return "sqrt(N) segments need at least two units"
    return None


def _sqrt(profile: Profile) -> list[Policies]:
    names = profile.unit_names
    n = len(names)
    if not_applicable(profile, "sqrt"):
        return []
    size = max(2, round(math.sqrt(n)))
    policies: Policies = {}
    for first in range(0, n, size):
        last = min(n, first + size) - 1
        role = segment(first, last) if last > first else FULL
        for j in range(first, last + 1):
            policies[names[j]] = role.policy(names)
    return [policies]


def _prefixes(profile: Profile, order: list[int]) -> list[Policies]:
    """Nothing checkpointed, then the units in ``order`` checkpointed one more at a time."""
    names = profile.unit_names
    policies = dict.fromkeys(names, KEEP)
    out = [dict(policies)]
    for j in order:
        policies[names[j]] = CHECKPOINT
        out.append(dict(policies))
    return out


def _first_k(profile: Profile) -> list[Policies]:
    return _prefixes(profile, list(range(len(profile.units))))


def _greedy(profile: Profile) -> list[Policies]:
    def gain(j: int) -> float:
        u = profile.units[j]
        saved = u.options[KEEP].stored_bytes - u.options[CHECKPOINT].stored_bytes
        return saved / max(u.options[CHECKPOINT].recompute_s, 1e-12)

    return _prefixes(profile, sorted(range(len(profile.units)), key=gain, reverse=True))


BASELINES: dict[str, Baseline] = {
    "none": Baseline(_none, "first"),
    "full": Baseline(_full, "first"),
    "every-k": Baseline(_every_k, "cheapest"),
    "sqrt": Baseline(_sqrt, "first"),
    "first-k": Baseline(_first_k, "first"),
    "greedy": Baseline(_greedy, "first"),
}


def predicted(baseline: Baseline, profile: Profile) -> tuple[list[Policies], list[Prediction]]:
    """The schedules ``baseline`` may use for this profile, each with its prediction: computed
    once, then ``pick`` chooses among them at any budget."""
    candidates = baseline.candidates(profile)
    return candidates, [predict(profile, c) for c in candidates]


def _strategy(baseline: Baseline) -> Callable[[Profile, int], Policies | None]:
    def choose(profile: Profile, budget: int) -> Policies | None:
        candidates, predictions = predicted(baseline, profile)
        k = pick(baseline, predictions, budget)
        return None if k is None else candidates[k]

    return choose


STRATEGIES: dict[str, Callable[[Profile, int], Policies | None]] = {
    name: _strategy(b) for name, b in BASELINES.items()
}
assert tuple(BASELINES) == BASELINE_NAMES, "the CLI offers memfit.planning.BASELINE_NAMES"
