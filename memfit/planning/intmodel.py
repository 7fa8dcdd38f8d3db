"""The integer data every solver works on (CP-SAT and CBC in ilp.py, the chain DP in dp.py):
bytes divided by a quantum and rounded up so that whatever fits the scaled model fits the real
one, recompute time in whole nanoseconds, and each role's costs as ``roles.unit_costs`` gives
them to ``predict``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from memfit.formats.profile import Profile, after_forwards
from memfit.planning.roles import FULL, NONE, Role, segment_roles, unit_costs, weighed
from memfit.policy import COARSE

RANGE = 2**30  # scaled bytes stay below this, far inside every solver's exact integer range


@dataclass(slots=True)
class IntPhase:
    unit: int | None
    kind: str  # "remainder", "forward", "backward"
    peak: int = 0  # remainder only
    end: int = 0
    ckpt_end: int = 0  # remainder's end when some unit holds outside tensors (IntCosts.holds)
    ckpt_peak: int = 0  # remainder's peak then (Phase.peak_with)
    later: bool = False  # a unit's later backward (IntCosts.backward)
    releases: bool = False  # leaving autocast: each unit's IntCosts.release is freed
    # the unit whose forward it follows: that unit's IntCosts.freed, and the unit's before it
    # IntCosts.later, leave at its end
    after: int | None = None


class IntCosts(NamedTuple):
    """One unit's phases under one role, in quanta: ``roles.Costs`` rounded up."""

    fwd_peak: int
    fwd_end: int
    bwd_peak: int
    bwd_end: int
    later_bwd_peak: int
    later_bwd_end: int
    release: int = 0  # rounded down: the level may only be over-estimated
    freed: int = 0  # the same
    later: int = 0  # the same (freed after the next unit's forward)
    after_peak: int = 0  # rounded up: added to the peak of the remainder after its forward
    holds: bool = True  # keeps tensors made outside the units: the remainders' checkpointed figures apply

    @property
    def net(self) -> int:
        """The level change over a forward, the remainders after it and the next unit's, and its
        first backward (the chain solvers' step, whose units run once)."""
        return self.fwd_end - self.freed - self.later + self.bwd_end

    def backward(self, later: bool) -> tuple[int, int]:
        return (self.later_bwd_peak, self.later_bwd_end) if later else (self.bwd_peak, self.bwd_end)


@dataclass(slots=True)
class IntModel:
    quantum: int
    baseline: int
    phases: list[IntPhase]
    roles: list[list[Role]]  # the roles each unit may take
    costs: dict[tuple[int, Role], IntCosts]
    recompute_ns: dict[tuple[int, Role], int]  # the objective: roles.weighed, recompute plus one standard error
    net: list[int]  # each unit's largest level change over the whole step, over its roles

    @property
    def n(self) -> int:
        return len(self.roles)

    @staticmethod
    def of(profile: Profile, *, segments: bool = True, max_segment: int = 8, fine: bool = False) -> IntModel:
        """The scaled model; segments (of up to ``max_segment`` units) only for chains; the
        profile's finer options (child modules, op sets) only when ``fine``."""
        figures = [profile.baseline_bytes,
                   *(abs(v) for p in profile.phases for v in (p.peak_with(True), p.end_bytes))]
        for u in profile.units:
            for o in u.options.values():
                figures += [abs(o.fwd_peak_bytes), abs(o.stored_bytes), abs(o.bwd_peak_bytes), abs(o.bwd_end_bytes),
                            *(abs(v) for v in (o.later_bwd_peak_bytes, o.later_bwd_end_bytes) if v is not None)]
        q = max(1, math.ceil(sum(figures) / RANGE))

        def up(x: float) -> int:
            return -int((-x) // q)

        after = after_forwards(profile.phases)
        phases = [
            IntPhase(p.unit, p.kind, up(p.peak_bytes), up(p.end_bytes), up(p.ckpt_end_bytes), up(p.peak_with(True)),
                     releases=p.releases, after=after.get(t))
            if p.unit is None
            else IntPhase(p.unit, p.kind, later=p.later)
            for t, p in enumerate(profile.phases)
        ]
        units = profile.units
        roles: list[list[Role]] = [
            [NONE, FULL, *(Role(k) for k in u.options if fine and k not in COARSE)] for u in units
        ]
        if segments and profile.segmentable:
            for seg in segment_roles(len(units), max_segment):
                for j in range(seg.first, seg.last + 1):
                    roles[j].append(seg)
        # One composition for every solver and for predict(): roles.unit_costs, each figure
        # rounded up, so that whatever fits the scaled model fits the real one.
        costs: dict[tuple[int, Role], IntCosts] = {}
        recompute: dict[tuple[int, Role], int] = {}
        for j in range(len(units)):
            for role in roles[j]:
                c = unit_costs(profile, j, role)
                costs[j, role] = IntCosts(up(c.fwd_peak), up(c.fwd_end), up(c.bwd_peak), up(c.bwd_end),
                                          up(c.later_bwd_peak), up(c.later_bwd_end), int(c.release // q),
                                          int(c.freed // q), int(c.later // q), up(c.after_peak), c.holds)
                recompute[j, role] = round(weighed(c.recompute_s, c.uncertainty_s) * 1e9)
        net = [max(costs[j, r].net for r in roles[j] if not r.is_segment) for j in range(len(units))]
        return IntModel(q, up(profile.baseline_bytes), phases, roles, costs, recompute, net)


@dataclass(slots=True)
class Layout:
    """Where each phase sits in a step whose units run forward in order and backward in reverse."""

    fwd: list[int]  # phase index of each unit's forward
    bwd: list[int]  # phase index of each unit's backward
    after_fwd: list[list[int]]  # remainder phases after unit j's forward, before the next unit phase
    after_bwd: list[list[int]]  # remainder phases after unit j's backward, before the next unit phase
    pre: list[int]  # remainder phases before the first forward


def chain_layout(model: IntModel) -> Layout | None:
    n = model.n
    if any(p.releases for p in model.phases):
        return None  # leaving autocast frees per-unit bytes in a remainder phase: the general timeline
    order = [(p.kind, p.unit) for p in model.phases if p.unit is not None]
    expected = [("forward", j) for j in range(n)] + [("backward", j) for j in reversed(range(n))]
    if order != expected:
        return None
    lay = Layout([0] * n, [0] * n, [[] for _ in range(n)], [[] for _ in range(n)], [])
    current: list[int] = lay.pre
    for t, p in enumerate(model.phases):
        if p.unit is None:
            current.append(t)
        elif p.kind == "forward":
            lay.fwd[p.unit] = t
            current = lay.after_fwd[p.unit]
        else:
            lay.bwd[p.unit] = t
            current = lay.after_bwd[p.unit]
    return lay
