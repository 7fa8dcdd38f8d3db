"""An exact dynamic program for chains: an independent check of the integer programs.

It walks the units in order, choosing a block at a time (a unit kept, a unit checkpointed, or
a segment of units checkpointed together), over one state: the bytes the forward has kept so
far (in the model's quantum, so memory is discretised exactly as the ILP sees it). Each unit is
given one net change over the step whatever its role (the largest; physically they are equal,
its gradients), so the level at any backward phase of a block is known as soon as the block is
chosen and every constraint is checked on the way. Where a profile's nets differ by role, the
DP is the more cautious of the solvers.
States that keep more bytes at a higher cost are dropped (Pareto front), which keeps it exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.errors import MemfitError
from memfit.planning.intmodel import IntModel, Layout, chain_layout
from memfit.planning.roles import NONE, Role


def solve_dp(model: IntModel, cap: int | None, minimize: str) -> tuple[list[Role], str, int] | None:
    """Same contract as the MIP backends: (roles, "optimal", objective) or None if nothing fits."""
    lay = chain_layout(model)
    if lay is None:
        raise MemfitError("the dp solver needs a chain: units whose forwards run in order and backwards in "
                          "reverse; use --solver cpsat")
    best = None
    for any_ckpt in (False, True):
        found = _run(model, lay, cap, minimize, any_ckpt)
        if found is not None and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        return None
    return best[0], "optimal", best[1]


def dp_exact(model: IntModel) -> bool:
    """The DPs are exact when the units' phases run as a chain (forwards in order, backwards in
    reverse), each unit changes the level by one net amount over the step, whatever its role, and
    no unit frees anything a unit late (``IntCosts.later``: the walk does not subtract it, which
    keeps it cautious there)."""
    return chain_layout(model) is not None and all(
        c.net == model.net[j] and c.later == 0 for (j, role), c in model.costs.items() if not role.is_segment)


class _Walk:
    """The levels of a chain step for one value of "some unit holds outside tensors" (a checkpoint:
    ``IntCosts.holds``): what a block (a unit, or a segment starting at it) does to the worst
    level, given the bytes kept before it."""

    def __init__(self, model: IntModel, lay: Layout, any_ckpt: bool) -> None:
        self.model, self.lay, n = model, lay, model.n
        ends = [(p.ckpt_end if any_ckpt else p.end) if p.unit is None else 0 for p in model.phases]
        self.peak = [p.ckpt_peak if any_ckpt else p.peak for p in model.phases]  # a remainder's
        self.before = [0] * (len(ends) + 1)  # remainder bytes added before each phase
        for t, e in enumerate(ends):
            self.before[t + 1] = self.before[t] + e
        self.netsuf = [0] * (n + 1)  # net of the units after j: netsuf[j + 1]
        for j in reversed(range(n)):
            self.netsuf[j] = self.netsuf[j + 1] + model.net[j]
        self.start = max([self.level(t, 0) + self.peak[t] for t in lay.pre], default=model.baseline)
        self._moves: dict[tuple[int, Role], tuple[int, int, int]] = {}

    def level(self, t: int, units_part: int) -> int:
        return self.model.baseline + self.before[t] + units_part

    def blocks(self, i: int, any_ckpt: bool) -> list[Role]:
        """The blocks that may start at unit ``i``: without a unit that holds outside tensors, only
        roles that hold none (``none``, ``derive``)."""
        if any_ckpt:
            return [r for r in self.model.roles[i] if not r.is_segment or r.first == i]
        return [r for r in self.model.roles[i] if not r.is_segment and not self.model.costs[i, r].holds]

    def block(self, i: int, role: Role, p0: int) -> tuple[int, int]:
        """(kept bytes after the block, highest level in the block's forward and backward).
        Every level in the block is the kept bytes ``p0`` plus a constant, so both are ``p0``
        plus constants of the block, worked out once."""
        kept, worst, _ = self._move(i, role)
        return p0 + kept, p0 + worst

    def cost(self, i: int, role: Role) -> int:
        """Recompute ns of the block."""
        return self._move(i, role)[2]

    def _move(self, i: int, role: Role) -> tuple[int, int, int]:
        """(kept bytes, highest level, recompute ns) of the block after zero kept bytes, once."""
        move = self._moves.get((i, role))
        if move is None:
            move = self._moves[i, role] = (*self._block(i, role), self._cost(i, role))
        return move

    def _block(self, i: int, role: Role) -> tuple[int, int]:
        model, lay, p0 = self.model, self.lay, 0
        last = role.last if role.is_segment else i
        members = range(i, last + 1)
        w, pf = -(2**62), p0
        for j in members:  # each member's forward, then the remainder after it, which frees its freed
            c = model.costs[j, role]
            w = max(w, self.level(lay.fwd[j], pf) + c.fwd_peak)
            pf += c.fwd_end
            for k, t in enumerate(lay.after_fwd[j]):  # the first frees them at its end
                w = max(w, self.level(t, pf) + self.peak[t] + (c.after_peak if k == 0 else 0))
                pf -= c.freed if k == 0 else 0
        ub = self.netsuf[last + 1] + pf  # unit bytes as the block's backward begins
        for j in reversed(members):
            _, fe, bp, be, *_ = model.costs[j, role]
            if not role.is_segment:  # one net per unit, the largest over its roles
                be = model.net[j] - fe + model.costs[j, role].freed
            w = max(w, self.level(lay.bwd[j], ub) + bp)
            ub += be
            if j > 0:
                w = max([w, *(self.level(t, ub) + self.peak[t] for t in lay.after_bwd[j])])
        return pf, w

    def floors(self, any_ckpt: bool) -> list[int]:
        """floors[i]: the least that the highest level from unit i's forward on can exceed the
        bytes kept before unit i, over every choice for units i.. (a lower bound for pruning)."""
        n = self.model.n
        floor = [0] * (n + 1)
        floor[n] = -(2**62)  # the last unit's block walks the remainder after its forward
        for i in reversed(range(n)):
            best = 2**62
            for role in self.blocks(i, any_ckpt):
                d, w = self.block(i, role, 0)
                last = role.last if role.is_segment else i
                best = min(best, max(w, d + floor[last + 1]))
            floor[i] = best
        return floor

    def finish(self, p: int) -> int:
        """The highest level after the first unit's backward (``p``, the bytes the forward kept,
        does not reach it: every unit has run its backward)."""
        return max([self.level(t, self.netsuf[0]) + self.peak[t] for t in self.lay.after_bwd[0]], default=-(2**62))

    def _cost(self, i: int, role: Role) -> int:
        last = role.last if role.is_segment else i
        return sum(self.model.recompute_ns[j, role] for j in range(i, last + 1))


def _run(
    model: IntModel, lay: Layout, cap: int | None, minimize: str, any_ckpt: bool
) -> tuple[list[Role], int] | None:
    n = model.n
    by_peak = minimize == "peak"
    walk = _Walk(model, lay, any_ckpt)
    if not by_peak and cap is not None and walk.start > cap:
        return None
    # frontier[i]: states after units 0..i-1 are decided, keyed by (kept bytes P, any checkpoint
    # so far), valued (recompute ns, worst level so far, back pointer).
    Entry = tuple[int, int, tuple[int, tuple[int, bool], Role] | None]
    frontier: list[dict[tuple[int, bool], Entry]] = [{} for _ in range(n + 1)]
    frontier[0][0, False] = (0, walk.start, None)
    for i in range(n):
        states = _pareto(frontier[i], by_peak)
        frontier[i] = states
        for (p0, seen), (cost, worst, _) in states.items():
            for role in walk.blocks(i, any_ckpt):
                pf, w = walk.block(i, role, p0)
                w = max(w, worst)
                if not (by_peak or cap is None or w <= cap):
                    continue
                last = role.last if role.is_segment else i
                key = (pf, seen or model.costs[i, role].holds)
                entry = (cost + walk.cost(i, role), w, (i, (p0, seen), role))
                old = frontier[last + 1].get(key)
                if old is None or _score(entry, by_peak) < _score(old, by_peak):
                    frontier[last + 1][key] = entry
    finals = []
    for (p, seen), (cost, worst, _back) in frontier[n].items():
        if any_ckpt and not seen:
            continue
        w = max(worst, walk.finish(p))
        if by_peak or cap is None or w <= cap:
            finals.append(((w, cost) if by_peak else (cost, w), (p, seen)))
    if not finals:
        return None
    score, key = min(finals)
    return trace_back(n, key, lambda pos, k: frontier[pos][k][2]), score[0]


def trace_back(n: int, key: Any, back: Callable[[int, Any], tuple[int, Any, Role] | None]) -> list[Role]:
    """Each unit's role, from the state ``key`` after the last unit: ``back(pos, key)`` is the
    (first unit, state before it, role) of the block that ends at ``pos``."""
    roles: list[Role] = [NONE] * n
    pos = n
    while pos > 0:
        step = back(pos, key)
        assert step is not None
        start, key, role = step
        for j in range(start, pos):
            roles[j] = role
        pos = start
    return roles


def _score(entry: tuple[int, int, object], by_peak: bool) -> tuple[int, int]:
    return (entry[1], entry[0]) if by_peak else (entry[0], entry[1])


def _pareto(states: dict, by_peak: bool) -> dict:  # type: ignore[type-arg]
    """Drop every state that keeps at least as many bytes as another at no lower score."""
    kept = {}
    for flag in (False, True):
        best = None
        for key in sorted(k for k in states if k[1] == flag):
            score = _score(states[key], by_peak)
            if best is None or score < best:
                kept[key] = states[key]
                best = score
    return kept
