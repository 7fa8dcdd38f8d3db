"""The memory and time model: the peak and the recompute time of any choice of options.

The step is the Profile's timeline of phases. Walking it from the baseline, each phase can
peak at ``level + peak`` and then moves the level by ``end``; a unit's phases take the
figures of the option chosen for it. The step's peak is the highest of these moments, so one
linear inequality per phase is the whole constraint set the ILP needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.devices import usable_bytes
from memfit.formats.layout import dp_degree
from memfit.formats.profile import Profile, after_forwards
from memfit.planning.roles import member_input, roles_of, unit_costs, weighed
from memfit.policy import FULL, KEEP, Policy, as_policies


@dataclass(slots=True)
class Prediction:
    peak_bytes: int
    peak_phase: str  # the phase at which the peak is reached
    recompute_s: float
    overhead: float  # recompute time / un-checkpointed step time
    levels: list[tuple[str, int, int]]  # (phase, level at its start, its peak), for timelines
    uncertainty_s: float = 0.0  # how sure recompute_s is: its options' uncertainties summed (they share rounds)
    overhead_uncertainty: float = 0.0  # the same as a share of the un-checkpointed step

    @property
    def weighed_s(self) -> float:
        """What the planner minimises (roles.weighed): recompute plus one standard error."""
        return weighed(self.recompute_s, self.uncertainty_s)


def predict(profile: Profile, policies: Mapping[str, Policy | str]) -> Prediction:
    """Peak bytes and recompute time of the step when each unit runs with its given policy
    (memfit/policy.py, as a value or spelt as in a schedule file; units not named are ``none``)."""
    roles = roles_of(profile, as_policies(policies))
    costs = [unit_costs(profile, j, r) for j, r in enumerate(roles)]
    level = profile.baseline_bytes
    peak, where = level, "start"
    levels = []
    any_ckpt = any(c.holds for c in costs)  # some unit keeps tensors made outside the units
    pending = 0  # a segment member's input, freed in the gap after the member (roles.member_input)
    after = after_forwards(profile.phases)
    for t, phase in enumerate(profile.phases):
        if phase.unit is None:
            p, e = phase.peak_with(any_ckpt), phase.ckpt_end_bytes if any_ckpt else phase.end_bytes
            e -= sum(c.release for c in costs) if phase.releases else 0
            if t in after:  # what the unit just run frees, and what the one before it frees a unit late
                p += costs[after[t]].after_peak
                e -= costs[after[t]].freed + (costs[after[t] - 1].later if after[t] > 0 else 0)
        elif phase.kind == "forward":
            p, e = costs[phase.unit].fwd_peak, costs[phase.unit].fwd_end
        else:
            p, e = costs[phase.unit].backward(phase.later)
        levels.append((phase.label, int(level + pending), int(level + pending + p)))
        if level + pending + p > peak:
            peak, where = level + pending + p, phase.label
        level += e
        pending = member_input(profile, phase.unit, roles[phase.unit]) if (
            phase.unit is not None and phase.kind == "forward") else 0
    recompute = sum(c.recompute_s for c in costs)
    sure = sum(c.uncertainty_s for c in costs)
    step = profile.step_s
    overhead, overhead_sure = (recompute / step, sure / step) if step > 0 else (0.0, 0.0)
    return Prediction(int(peak), where, recompute, overhead, levels, sure, overhead_sure)


def fsdp_headroom(profile: Profile) -> int:
    """Bytes a per-rank FSDP2 plan should leave free: one unit's parameters, gathered at their
    own (fp32) size. Under fsdp-bf16 the gathers are half that, but its fp32 gradient reduction
    moves the peak too: 2 gloo ranks on gpt-small saw the all-checkpointed step's peak differ by
    8 MiB between runs, more than the bf16 gather alone."""
    if not profile.parallel or not profile.parallel["kind"].startswith("fsdp"):  # fsdp, fsdp-bf16
        return 0
    return max(u.param_bytes for u in profile.units) * dp_degree(profile.parallel)


def allocator_ratio(profile: Profile, policies: Mapping[str, Policy | str]) -> float | None:
    """What the caching allocator's model (estimate mode for a CUDA target: measure/allocator.py)
    reserves over what is allocated, for a plan of ``policies``: between the estimate's step with
    every unit kept and with every unit ``full``, by the share of units the plan recomputes
    something of. None where the profile has no such model (measured, the CPU, older files)."""
    reserved, allocated = profile.reserved_peak_bytes, profile.measured_peak_bytes
    if not all(reserved.get(o) and allocated.get(o) for o in (KEEP, FULL)) or not profile.units:
        return None
    kept, full = (reserved[o] / allocated[o] for o in (KEEP, FULL))
    share = sum(p != KEEP for p in as_policies(dict(policies)).values()) / len(profile.units)
    return kept + share * (full - kept)


def device_cap_bytes(profile: Profile, policies: Mapping[str, Policy | str] | None = None) -> int | None:
    """The most a plan's peak may reach on the profile's GPU: its usable memory (devices.py) less
    the FSDP headroom; None where the profile records no device memory (the CPU). With the plan's
    ``policies``, the margin is the larger of the device's and what the allocator's model has that
    plan reserve over its allocated peak (``allocator_ratio``): never less than the fixed margin
    keeps free, more where the model sees the allocator keep more (FSDP2 with every layer
    checkpointed: 30% over, docs/estimate.md), the model's ratio raised by the record's
    ``over_model`` (what a run on the card found the allocator to reserve over the model's)."""
    if not profile.memory:
        return None
    memory = profile.memory
    ratio = card_ratio(profile, policies) if policies is not None else None
    if ratio is not None and ratio > 1 + memory["margin"]:
        memory = {**memory, "margin": ratio - 1}
    return usable_bytes(memory) - fsdp_headroom(profile)


def card_ratio(profile: Profile, policies: Mapping[str, Policy | str]) -> float | None:
    """What the card is expected to reserve over a plan's allocated peak: the allocator model's
    ratio (``allocator_ratio``) raised by the memory record's ``over_model``, what a run on the
    card found it to reserve over the model's. None where the profile has no such model."""
    ratio = allocator_ratio(profile, policies)
    if ratio is None:
        return None
    return ratio * (1 + (profile.memory or {}).get("over_model", 0.0))
