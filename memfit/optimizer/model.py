"""The memory and time model: the peak and the recompute time of any choice of options.

The step is the Profile's timeline of phases. Walking it from the baseline, each phase can
peak at ``level + peak`` and then moves the level by ``end``; a unit's phases take the
figures of the option chosen for it. The step's peak is the highest of these moments, so one
linear inequality per phase is the whole constraint set the ILP needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.profile import OPTIONS, Profile


@dataclass(slots=True)
class Prediction:
    peak_bytes: int
    peak_phase: str  # the phase at which the peak is reached
    recompute_s: float
    overhead: float  # recompute time / un-checkpointed step time
    levels: list[tuple[str, int, int]]  # (phase, level at its start, its peak), for timelines


def choices(profile: Profile, policies: Mapping[str, str]) -> list[str]:
    """The option of each unit, in order; units not named are ``none``."""
    known = set(profile.unit_names)
    unknown = [n for n in policies if n not in known]
    if unknown:
        raise MemfitError(f"no unit named {unknown[0]!r} in the profile; units: {profile.unit_names}")
    out = []
    for name in profile.unit_names:
        option = policies.get(name, "none")
        if option not in OPTIONS:
            raise MemfitError(f"unknown policy {option!r} for unit {name!r}; use one of {OPTIONS}")
        out.append(option)
    return out


def predict(profile: Profile, policies: Mapping[str, str]) -> Prediction:
    """Peak bytes and recompute time of the step when each unit runs with its given policy."""
    chosen = choices(profile, policies)
    level = profile.baseline_bytes
    peak, where = level, "start"
    levels = []
    any_ckpt = any(o != "none" for o in chosen)
    for phase in profile.phases:
        if phase.unit is None:
            p, e = phase.peak_bytes, phase.ckpt_end_bytes if any_ckpt else phase.end_bytes
        else:
            cost = profile.units[phase.unit].options[chosen[phase.unit]]
            if phase.kind == "forward":
                p, e = cost.fwd_peak_bytes, cost.stored_bytes
            else:
                p, e = cost.bwd_peak_bytes, cost.bwd_end_bytes
        levels.append((phase.label, level, level + p))
        if level + p > peak:
            peak, where = level + p, phase.label
        level += e
    recompute = sum(u.options[o].recompute_s for u, o in zip(profile.units, chosen, strict=True))
    overhead = recompute / profile.step_s if profile.step_s > 0 else 0.0
    return Prediction(peak, where, recompute, overhead, levels)
