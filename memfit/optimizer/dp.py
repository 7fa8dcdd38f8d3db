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

from memfit.errors import MemfitError
from memfit.optimizer.ilp import IntModel, Layout, chain_layout
from memfit.optimizer.roles import NONE, Role


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


def _run(
    model: IntModel, lay: Layout, cap: int | None, minimize: str, any_ckpt: bool
) -> tuple[list[Role], int] | None:
    n = model.n
    by_peak = minimize == "peak"
    ends = [(p.ckpt_end if any_ckpt else p.end) if p.unit is None else 0 for p in model.phases]
    before = [0] * (len(ends) + 1)  # remainder bytes added before each phase
    for t, e in enumerate(ends):
        before[t + 1] = before[t] + e
    netsuf = [0] * (n + 1)  # net of the units after j: netsuf[j + 1]
    for j in reversed(range(n)):
        netsuf[j] = netsuf[j + 1] + model.net[j]
    base = model.baseline

    def level(t: int, units_part: int) -> int:
        return base + before[t] + units_part

    def fits(value: int, worst: int) -> tuple[bool, int]:
        worst = max(worst, value)
        return (by_peak or cap is None or value <= cap), worst

    start_worst = max([level(t, 0) + model.phases[t].peak for t in lay.pre], default=base)
    if not by_peak and cap is not None and start_worst > cap:
        return None
    # frontier[i]: states after units 0..i-1 are decided, keyed by (kept bytes P, any checkpoint
    # so far), valued (recompute ns, worst level so far, back pointer).
    Entry = tuple[int, int, tuple[int, tuple[int, bool], Role] | None]
    frontier: list[dict[tuple[int, bool], Entry]] = [{} for _ in range(n + 1)]
    frontier[0][0, False] = (0, start_worst, None)
    for i in range(n):
        states = _pareto(frontier[i], by_peak)
        frontier[i] = states
        blocks = [r for r in model.roles[i] if r.kind != "segment" or r.first == i] if any_ckpt else [NONE]
        for (p0, seen), (cost, worst, _) in states.items():
            for role in blocks:
                last = role.last if role.kind == "segment" else i
                members = range(i, last + 1)
                ok, w, pf = True, worst, p0
                for j in members:  # each member's forward, then the remainder after it
                    fp, fe, _, _ = model.costs[j, role]
                    w = max(w, level(lay.fwd[j], pf) + fp)
                    pf += fe
                    if j < n - 1:
                        w = max([w, *(level(t, pf) + model.phases[t].peak for t in lay.after_fwd[j])])
                ub = netsuf[last + 1] + pf  # unit bytes as the block's backward begins
                for j in reversed(members):
                    _, fe, bp, be = model.costs[j, role]
                    if role.kind != "segment":  # one net per unit, the largest over its roles
                        be = model.net[j] - fe
                    w = max(w, level(lay.bwd[j], ub) + bp)
                    ub += be
                    if j > 0:
                        w = max([w, *(level(t, ub) + model.phases[t].peak for t in lay.after_bwd[j])])
                ok = by_peak or cap is None or w <= cap
                if not ok:
                    continue
                key = (pf, seen or role != NONE)
                entry = (cost + sum(model.recompute_ns[j, role] for j in members), w, (i, (p0, seen), role))
                old = frontier[last + 1].get(key)
                if old is None or _score(entry, by_peak) < _score(old, by_peak):
                    frontier[last + 1][key] = entry
    finals = []
    for (p, seen), (cost, worst, _back) in frontier[n].items():
        if any_ckpt and not seen:
            continue
        w = max([worst, *(level(t, p) + model.phases[t].peak for t in lay.after_fwd[n - 1])])
        w = max([w, *(level(t, netsuf[0]) + model.phases[t].peak for t in lay.after_bwd[0])])
        if by_peak or cap is None or w <= cap:
            finals.append(((w, cost) if by_peak else (cost, w), (p, seen)))
    if not finals:
        return None
    score, key = min(finals)
    roles: list[Role] = [NONE] * n
    pos = n
    while pos > 0:
        back = frontier[pos][key][2]
        assert back is not None
        start, key, role = back
        for j in range(start, pos):
            roles[j] = role
        pos = start
    return roles, score[0]


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
