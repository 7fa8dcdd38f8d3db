"""The whole memory / recompute frontier of a chain, from one dynamic program.

``plan`` answers one budget. A sweep asks for many, and the answers share most of their work:
the chain DP of dp.py, run with no budget and keeping every state that is not dominated in
(kept bytes, recompute, worst level so far) instead of the best one per kept bytes, ends with
every plan on the frontier at once. Reading a budget off it is a lookup: the cheapest point
whose peak fits. Levels are the integer model's (IntModel), exactly as the ILP and dp.py see them.

Given the budgets to be read (``caps``), a state's worst level only matters through the smallest
cap it fits, so levels are rounded up to the caps first: the answer at every cap stays exact
and far fewer states survive (a 30-budget sweep of an 80-unit chain: about 20x fewer).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from memfit.planning.dp import _Walk, trace_back
from memfit.planning.intmodel import IntModel, chain_layout
from memfit.planning.roles import Role

_NEVER = 2**63  # a level above every cap
# (kept bytes P, some unit holds outside tensors so far, recompute ns, worst level so far, back pointer)
_Entry = tuple[int, bool, int, int, tuple[int, int, Role] | None]


@dataclass(slots=True)
class FrontierPoint:
    peak: int  # scaled bytes, as the integer model counts them
    recompute_ns: int
    roles: list[Role]


def chain_frontier(model: IntModel, caps: list[int] | None = None) -> list[FrontierPoint] | None:
    """Every plan on the frontier, by rising peak and falling recompute; None if not a chain.
    With ``caps`` (scaled budgets), the cheapest plan for each cap that any plan fits, with its
    peak rounded up to that cap."""
    lay = chain_layout(model)
    if lay is None:
        return None
    grid = sorted(set(caps)) if caps is not None else None
    found: list[FrontierPoint] = []
    for any_ckpt in (False, True):
        found += _run(_Walk(model, lay, any_ckpt), model.n, any_ckpt, grid)
    found.sort(key=lambda f: (f.peak, f.recompute_ns))
    points: list[FrontierPoint] = []
    for f in found:
        if not points or f.recompute_ns < points[-1].recompute_ns:
            points.append(f)
    return points


def read(points: list[FrontierPoint], cap: int) -> FrontierPoint | None:
    """The cheapest point whose peak fits ``cap`` (scaled bytes); None when none does."""
    k = bisect.bisect_right([p.peak for p in points], cap)
    return points[k - 1] if k else None


def _run(walk: _Walk, n: int, any_ckpt: bool, grid: list[int] | None) -> list[FrontierPoint]:
    def up(level: int) -> int:  # a level rounded up to the grid; past its top: never fits
        if grid is None:
            return level
        k = bisect.bisect_left(grid, level)
        return grid[k] if k < len(grid) else _NEVER

    floor = walk.floors(any_ckpt)  # the rest of the step reaches at least kept bytes + floor
    stages: list[list[_Entry]] = [[] for _ in range(n + 1)]
    stages[0] = [(0, False, 0, up(max(walk.start, floor[0])), None)]
    for i in range(n):
        stages[i] = _prune(stages[i])
        blocks = walk.blocks(i, any_ckpt)
        for idx, (p0, seen, cost, worst, _) in enumerate(stages[i]):
            for role in blocks:
                pf, w = walk.block(i, role, p0)
                last = role.last if role.is_segment else i
                # Counting what the rest will surely reach merges states that end alike, early.
                w = max(up(max(w, pf + floor[last + 1])), worst)
                if w == _NEVER:
                    continue
                held = seen or walk.model.costs[i, role].holds
                stages[last + 1].append((pf, held, cost + walk.cost(i, role), w, (i, idx, role)))
    ends = [(max(e[3], up(walk.finish(e[0]))), e[2], k) for k, e in enumerate(stages[n]) if e[1] or not any_ckpt]
    ends.sort()
    points = []
    for peak, cost, k in ends:
        if peak == _NEVER or (points and cost >= points[-1].recompute_ns):
            continue
        points.append(FrontierPoint(peak, cost, trace_back(n, k, lambda pos, idx: stages[pos][idx][4])))
    return points


def _prune(entries: list[_Entry]) -> list[_Entry]:
    """Drop each state that keeps at least the bytes of another at no lower recompute and no
    lower worst level: whatever follows, the other does at least as well."""
    kept: list[_Entry] = []
    for flag in (False, True):
        costs: list[int] = []  # a staircase: recompute rising, worst level falling
        worsts: list[int] = []
        for e in sorted((e for e in entries if e[1] == flag), key=lambda e: (e[0], e[2], e[3])):
            _, _, cost, worst, _ = e
            k = bisect.bisect_right(costs, cost)
            if k and worsts[k - 1] <= worst:
                continue  # fewer or equal bytes, cost and worst level: dominated
            end = k
            while end < len(costs) and worsts[end] >= worst:
                end += 1
            costs[k:end], worsts[k:end] = [cost], [worst]
            kept.append(e)
    return kept
