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

from memfit.optimizer.model import predict
from memfit.optimizer.roles import SEGMENT, Role
from memfit.profile import Profile

Policies = dict[str, str]


def _fits(profile: Profile, policies: Policies, budget: int) -> bool:
    return predict(profile, policies).peak_bytes <= budget


def _cheapest(profile: Profile, candidates: list[Policies], budget: int) -> Policies | None:
    """The candidate with the least recompute among those that fit (each predicted once)."""
    fitting = [(pred.recompute_s, i) for i, pred in enumerate(predict(profile, p) for p in candidates)
               if pred.peak_bytes <= budget]
    return candidates[min(fitting)[1]] if fitting else None


def none(profile: Profile, budget: int) -> Policies | None:
    p = dict.fromkeys(profile.unit_names, "none")
    return p if _fits(profile, p, budget) else None


def full(profile: Profile, budget: int) -> Policies | None:
    p = dict.fromkeys(profile.unit_names, "full")
    return p if _fits(profile, p, budget) else None


def every_k(profile: Profile, budget: int) -> Policies | None:
    """k = 1, 2, ... N, and k = infinity (nothing checkpointed)."""
    names = profile.unit_names
    candidates = [
        {n: "full" if (j + 1) % k == 0 else "none" for j, n in enumerate(names)} for k in range(1, len(names) + 1)
    ]
    return _cheapest(profile, [*candidates, dict.fromkeys(names, "none")], budget)


def not_applicable(profile: Profile, strategy: str) -> str | None:
    """Why ``strategy`` has no schedule for this profile at any budget; None when it has."""
    if strategy == "sqrt" and not profile.chain:
        return ("sqrt(N) checkpoints runs of several units as one segment, which memfit offers only when the "
                "units form a chain (each unit's only input is the previous unit's output) and hold no "
                "BatchNorm; these units do not")
    if strategy == "sqrt" and len(profile.units) < 2:
        return "sqrt(N) segments need at least two units"
    return None


def sqrt(profile: Profile, budget: int) -> Policies | None:
    names = profile.unit_names
    n = len(names)
    if not_applicable(profile, "sqrt"):
        return None
    size = max(2, round(math.sqrt(n)))
    policies: Policies = {}
    for first in range(0, n, size):
        last = min(n, first + size) - 1
        role = Role(SEGMENT, first, last) if last > first else Role("full")
        for j in range(first, last + 1):
            policies[names[j]] = role.policy(names)
    return policies if _fits(profile, policies, budget) else None


def first_k(profile: Profile, budget: int) -> Policies | None:
    names = profile.unit_names
    for k in range(len(names) + 1):
        p = {n: "full" if j < k else "none" for j, n in enumerate(names)}
        if _fits(profile, p, budget):
            return p
    return None


def greedy(profile: Profile, budget: int) -> Policies | None:
    def gain(j: int) -> float:
        u = profile.units[j]
        saved = u.options["none"].stored_bytes - u.options["full"].stored_bytes
        return saved / max(u.options["full"].recompute_s, 1e-12)

    policies = dict.fromkeys(profile.unit_names, "none")
    for j in sorted(range(len(profile.units)), key=gain, reverse=True):
        if _fits(profile, policies, budget):
            return policies
        policies[profile.unit_names[j]] = "full"
    return policies if _fits(profile, policies, budget) else None


STRATEGIES: dict[str, Callable[[Profile, int], Policies | None]] = {
    "none": none,
    "full": full,
    "every-k": every_k,
    "sqrt": sqrt,
    "first-k": first_k,
    "greedy": greedy,
}
