"""Option times that hold on a shared machine.

A step's overhead is measured without bias (whole steps, interleaved: measure/timing.py), but
with the whole step's noise, as much as a block's option on a shared 2-core machine; how it
splits among the units is worse: one unit's forward and backward run a few milliseconds longer,
and the difference is mostly noise (one option was priced 0.0 to 9.6 ms over eight blocks of the
same shape). The time an option's own work takes in a step (recomputing, and derive's hooks),
timed where it runs (``measure/host.Work``, on a CPU clock), has its own small noise. So:

- each option's overhead is drawn toward a fit to its work's time where its own measurement is
  unsure (``blended``), and shared among the units by the time each structure worked
  (``shares_by_work``);
- where no work was timed (an op set, whose cost is its dispatch modes; estimate mode):
  units of one **structure** (class, parameter shapes and dtypes, input, saved and output bytes)
  pool their samples: every member, every round, one median, one cost each;
  a structure whose measured difference is within its own noise is priced by a model
  **calibrated** on the structures above it: its share is its forward time times the
  measured overhead per forward second of those (all of them by forward time if none is);
- every cost keeps its **uncertainty** (``OptionCost.recompute_uncertainty_s``): that of the
  step's measured overhead (``timing.ratio_uncertainties``: its own, never below that of all the
  options timed in the same rounds pooled), or the blended one's, split as the cost is.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from torch import nn

from memfit.errors import NoisyTimesWarning
from memfit.formats.profile import Profile
from memfit.measure.timing import iqr, median_ratio
from memfit.policy import FULL, Option, Policy, Segment, Selective
from memfit.profiler.saved import UnitFacts
from memfit.runtime.marks import Stretch

CLEAR = 2.0  # a difference counts when its median exceeds this many IQR / sqrt(samples) (~2 standard errors)
STRAY = 0.3  # identical units whose plain times scatter by more than this fraction are warned of


def structures(model: nn.Module, names: list[str], facts: UnitFacts) -> list[int]:
    """Each unit's structure, numbered in order of first appearance: units of one class, parameter
    shapes and dtypes, and input, saved and output bytes do the same work."""
    keys: dict[tuple[object, ...], int] = {}
    out = []
    for j, name in enumerate(names):
        unit = model.get_submodule(name)
        key = (type(unit), *((n, tuple(p.shape), p.dtype) for n, p in unit.named_parameters()),
               facts.inputs[j], facts.saved[j], facts.outputs[j])
        out.append(keys.setdefault(key, len(keys)))
    return out


def pooled(samples: Sequence[Sequence[float]], groups: list[int]) -> list[float]:
    """Per unit: the median of its structure's samples (``samples[j]``: unit j's, one per round)."""
    by: dict[int, list[float]] = {}
    for j, g in enumerate(groups):
        by.setdefault(g, []).extend(samples[j])
    return [statistics.median(by[g]) for g in groups]


def check_alike(samples: Sequence[Sequence[float]], groups: list[int], names: list[str]) -> None:
    """Warn when the plain forward times of units that do the same work scatter from round to
    round (the typical member's interquartile range above ``STRAY`` of its median): the machine
    was busy, and even the pooled costs are unsure. A steady difference of one member (the first
    unit's stretch carries some of the step's own work) is not scatter: pooling sets it aside."""
    for members in _members(groups, range(len(groups))).values():
        if len(members) < 2 or len(samples[members[0]]) < 3:  # one round cannot tell noise from a difference
            continue
        scatter = statistics.median(_relative_iqr(samples[j]) for j in members)
        if scatter > STRAY:
            xs = [x for j in members for x in samples[j]]
            warnings.warn(NoisyTimesWarning(
                f"{', '.join(names[j] for j in members[:3])}{' ...' if len(members) > 3 else ''} do the same work, "
                f"but their forwards took {min(xs) * 1e3:.2f} to {max(xs) * 1e3:.2f} ms, each scattering by "
                f"{scatter:.0%} over the rounds: the machine was busy while profiling; their costs are pooled, but "
                "profile again on a quiet machine, or with more --repeat, for times to rely on"), stacklevel=3)


def _relative_iqr(xs: Sequence[float]) -> float:
    mid = statistics.median(xs)
    return iqr(list(xs)) / mid if mid > 0 else 0.0


def _members(groups: list[int], units: Iterable[int]) -> dict[int, list[int]]:
    """Structure -> those of ``units`` that have it, in order."""
    by: dict[int, list[int]] = {}
    for j in units:
        by.setdefault(groups[j], []).append(j)
    return by


def shares(longer: dict[int, list[float]], forward_s: dict[int, float], groups: list[int]) -> dict[int, float]:
    """Each unit's fraction of an option's measured overhead. ``longer[j]``: per round, how much
    longer unit j's forward and backward ran with the option than without; ``forward_s``: its
    plain forward time (the cost model's size)."""
    by = _members(groups, longer)
    measured: dict[int, float] = {}  # structure -> per-member difference, where clear of the noise
    for g, members in by.items():
        xs = [x for j in members for x in longer[j]]
        mid = statistics.median(xs)
        if len(xs) < 3:  # nothing tells the noise: take the measurement as it is
            measured[g] = max(0.0, mid)
            continue
        if mid > CLEAR * iqr(xs) / math.sqrt(len(xs)):
            measured[g] = mid
    fwd = {g: statistics.median(forward_s[j] for j in members) for g, members in by.items()}
    known = [g for g in measured if fwd[g] > 0]
    per_second = (sum(measured[g] * len(by[g]) for g in known) / sum(fwd[g] * len(by[g]) for g in known)
                  if known and any(measured[g] > 0 for g in known) else 1.0)
    weight = {j: measured.get(groups[j], fwd[groups[j]] * per_second) for j in longer}
    total = sum(weight.values())
    return {j: w / total if total > 0 else 1 / len(weight) for j, w in weight.items()}


def shares_by_work(work: dict[int, list[float]], groups: list[int], found: Overhead) -> dict[int, float]:
    """Each unit's fraction of an option's overhead (``found``) by the time of its own work
    (``work[j]``: per round) as ``blended`` fitted it, with what each unit costs beside it, pooled
    by structure as ``shares`` pools."""
    by = _members(groups, work)
    fixed = found.per_unit_s / found.slope if found.slope > 0 else 0.0  # in seconds of work
    mid = {g: max(0.0, statistics.median(x for j in members for x in work[j]) + fixed) for g, members in by.items()}
    total = sum(mid[groups[j]] for j in work)
    return {j: mid[groups[j]] / total if total > 0 else 1 / len(work) for j in work}


def seconds(run: list[Stretch]) -> float:
    return sum(s.seconds for s in run)


@dataclass(frozen=True, slots=True)
class Overhead:
    """What an option added to the step, in a measured step's seconds."""

    seconds: float  # (the median ratio of its steps to the plain ones, interleaved) - 1, times the plain step
    uncertainty_s: float  # two standard errors of ``seconds``; NaN: too few rounds to tell
    work_s: float = 0.0  # of its steps, the median time of the option's own work (``measure/host.Work``; op sets: 0)
    units: int = 0  # how many units ran it
    slope: float = 1.0  # ``blended``'s fit: seconds of overhead per second of work,
    per_unit_s: float = 0.0  # and per unit that ran it


def overhead(plain: list[list[Stretch]], runs: list[list[Stretch]], sure: float, units: int = 0) -> Overhead:
    """The overhead of the option that ran ``runs`` on ``units`` units, interleaved with ``plain``;
    ``sure``: the ratio's uncertainty (``timing.ratio_uncertainties``)."""
    steps = [seconds(r) for r in plain]
    step_s = statistics.median(steps)
    return Overhead((median_ratio(steps, [seconds(r) for r in runs]) - 1.0) * step_s, sure * step_s,
                    statistics.median(worked(r) for r in runs), units)


def worked(run: list[Stretch]) -> float:
    return sum(s.work_s for s in run)


def blended(found: Sequence[Overhead]) -> list[Overhead]:
    """Each option's overhead, drawn toward a fit to the time of its own work where the step's
    difference is unsure: an empirical-Bayes estimate (docs/timing.md, "Prices from the options'
    own work").

    A step's measured overhead is unbiased but carries the whole step's noise (on a shared 2-core
    machine ±1 to ±2% of a step: as much as a block's option); the option's own work (recomputing,
    derive's hooks), timed where it runs, has its own small noise, but leaves out what else the
    option changes (the module hooks, the backward's caches, the allocator). So the overheads are
    fitted as ``k`` times the work's time plus ``h`` per unit that ran the option (weighted least
    squares over the options, ``full`` among them; ``k`` came out 0.99 to 1.02 on nanoGPT,
    vit-tiny and cnn-mixed, ``h`` 0 to 0.9 ms a block); what each overhead is off that fit beyond
    its own noise estimates how much options really differ from it (``tau²``, the
    DerSimonian-Laird moment estimate for a regression); each option's price is the fit plus its
    own difference shrunk by ``tau² / (tau² + its variance)``. A noisy overhead of an option like
    the others is priced near the fit; one measured sure, or of an option that really differs,
    keeps its measurement.
    Options with too few rounds, or no work timed anywhere (estimate mode's clock), keep their
    overheads as measured; a fit of fewer than four options has no ``h``."""
    rows = [n for n, o in enumerate(found) if math.isfinite(o.uncertainty_s)]
    if len(rows) < 2 or not any(found[n].work_s > 0 for n in rows):
        return list(found)
    y = np.array([found[n].seconds for n in rows])
    var = np.array([max(found[n].uncertainty_s / 2, 1e-7) ** 2 for n in rows])  # one standard error, squared
    w = 1 / var
    x = np.array([[found[n].work_s, found[n].units] for n in rows], dtype=float)
    if len(rows) <= 3 or np.linalg.matrix_rank(x.T @ (x * w[:, None])) < 2:
        x = x[:, :1]  # too few options for a cost per unit, or every option ran on as many units as its work says
    inv = np.linalg.inv(x.T @ (x * w[:, None]))
    beta = inv @ (x.T @ (w * y))
    apart = y - x @ beta
    q = float(w @ apart ** 2)
    c = float(w.sum() - np.trace(inv @ (x.T @ (x * (w ** 2)[:, None]))))
    tau2 = max(0.0, (q - (len(rows) - x.shape[1])) / c) if c > 0 else 0.0
    k, h = float(beta[0]), float(beta[1]) if x.shape[1] > 1 else 0.0
    out = list(found)
    for i, n in enumerate(rows):
        b = tau2 / (tau2 + var[i])
        fit = float(x[i] @ beta)
        spread = b * var[i] + (1 - b) ** 2 * float(x[i] @ inv @ x[i])  # its own, and the fit's
        out[n] = Overhead(fit + b * apart[i], 2 * math.sqrt(spread), found[n].work_s, found[n].units, k, h)
    return out


def overheads(plain: list[list[Stretch]], runs: list[list[list[Stretch]]], sure: list[float],
              units: list[int], options: list[Option]) -> list[Overhead]:
    """Each option's overhead over the plain step (``full`` first; ``units``: how many units ran
    each), drawn toward the time of its own work (``blended``). Op sets keep theirs as measured,
    with no work: their dispatch modes cost over every op of the region, which no timed section
    shows."""
    found = [overhead(plain, r, u, n) for r, u, n in zip(runs, sure, units, strict=True)]
    working = [k for k, o in enumerate(options) if not isinstance(o, Selective)]
    out = [replace(o, work_s=0.0) for o in found]  # what stays so: the op sets
    for k, o in zip(working, blended([found[k] for k in working]), strict=True):
        out[k] = o
    return out


def recompute_factor(plain: list[list[Stretch]], full: Overhead) -> tuple[float, float]:
    """Recompute time of the units over their own forward time, such that checkpointing every
    unit costs the overhead measured for it (``full``: as ``blended``), and its uncertainty.

    Recomputing a forward inside backward is not exactly as dear as the first forward (no
    tensors are saved, memory is reused, hooks and RNG handling add a little), so the forward
    times scaled by this factor become the recompute times. The overhead is the median ratio of
    adjacent plain and all-checkpointed steps, as ``validate`` measures a plan; the units' marks
    give each unit's share. Kept within ``FACTOR_BOUNDS``.
    """
    forward = sum(statistics.median(run[k].seconds for run in plain)
                  for k, s in enumerate(plain[0]) if s.label.startswith("fwd:"))
    if forward <= 0:
        return 1.0, 0.0
    return _bounded(full.seconds / forward), 0.0 if math.isnan(full.uncertainty_s) else full.uncertainty_s / forward


FACTOR_BOUNDS = (0.25, 2.0)  # a recompute factor beyond these is a noisy measurement's, not a unit's


def _bounded(factor: float) -> float:
    low, high = FACTOR_BOUNDS
    return min(high, max(low, factor))


def segments(names: list[str], size: int) -> dict[str, Policy]:
    """Units checkpointed ``size`` by ``size`` as segments from the first (a lone unit left over:
    ``full``); two by two, the step that prices what a segment's members before its last cost
    (``add_members``)."""
    out: dict[str, Policy] = {}
    for i in range(0, len(names), size):
        group = names[i:i + size]
        out.update({n: Segment(group[0], group[-1]) if len(group) > 1 else FULL for n in group})
    return out


def add_members(prof: Profile, paired_policies: dict[str, Policy], plain: list[list[Stretch]],
                paired: list[list[Stretch]], sure: float, measured: int, per_step: int) -> None:
    """Each unit's ``member_s``: its recompute as a segment member before the last, from the
    step of units in segments (``paired_policies``, ``segments(names, 2)``), whose measured
    overhead is each segment's last unit (and a lone one) at ``full``'s factor and the others at a
    factor of their own, the members' (over their forward time, as ``recompute_factor``; within
    the same bounds), with that step's uncertainty.
    The same kernels run again, yet dearer: a backward that its own recompute runs right before
    finds its tensors in the cache (benchmarks/segments.py, nanoGPT: every block alone +25.4%, in
    pairs +27.7%)."""
    members = [isinstance(p := paired_policies[u.name], Segment) and p.last != u.name for u in prof.units]
    member_s = sum(u.fwd_s for u, m in zip(prof.units, members, strict=True) if m) * measured
    rest_s = sum(u.fwd_s for u in prof.units) * measured - member_s
    if member_s <= 0:
        return
    steps = [seconds(r) for r in plain]
    step_s = statistics.median(steps)
    overhead_s = (median_ratio(steps, [seconds(r) for r in paired]) - 1.0) * step_s
    factor = _bounded((overhead_s - prof.recompute_factor * rest_s) / member_s)
    spread = 0.0 if math.isnan(sure) else sure * step_s / member_s
    for u in prof.units:
        u.member_s, u.member_uncertainty_s = u.fwd_s * factor * per_step, u.fwd_s * spread * per_step
