"""What each unit does in a schedule (its role) and what that costs, from a Profile.

A role is ``none`` (keep everything), ``full`` (checkpoint the unit), a finer option measured
by the profiler (``child:mlp``: checkpoint only that child; ``selective:gemm``: an op-level
policy), costed exactly as none and full are, or membership of a segment ``i..k``: units i
to k checkpointed as one region that keeps only unit i's input and rematerialises the whole
region when the gradient reaches unit k. A schedule's policies spell
a segment member as ``segment:<first unit>..<last unit>``.

Segment costs are composed from the two measured options: a member runs its forward as if
checkpointed and its inner outputs are freed at once; at unit k's backward the members before
k come back as they were without checkpointing, then k recomputes and runs backward; the
members before k then run backward as kept units. A region keeps one RNG state (on the CPU),
where checkpointing each member alone keeps one each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.profile import OPTIONS, Profile
from memfit.schedule import segment_span

SEGMENT = "segment"


@dataclass(frozen=True, slots=True)
class Role:
    kind: str  # "none", "full", "segment" or a finer option ("child:mlp", "selective:gemm")
    first: int = -1
    last: int = -1

    def policy(self, names: list[str]) -> str:
        return f"{SEGMENT}:{names[self.first]}..{names[self.last]}" if self.kind == SEGMENT else self.kind


NONE, FULL = Role("none"), Role("full")


@dataclass(frozen=True, slots=True)
class Costs:
    """One unit's phases under one role: (peak, end) of forward and of backward, and time."""

    fwd_peak: int | float
    fwd_end: int | float
    bwd_peak: int | float
    bwd_end: int | float
    recompute_s: float


def policies_of(names: list[str], roles: list[Role]) -> dict[str, str]:
    """Each unit's policy, as a schedule spells it: the inverse of ``roles_of``."""
    return {n: r.policy(names) for n, r in zip(names, roles, strict=True)}


def roles_of(profile: Profile, policies: Mapping[str, str]) -> list[Role]:
    """Each unit's role; units not named are ``none``. Segments must be contiguous and whole."""
    names = profile.unit_names
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in policies if n not in index]
    if unknown:
        raise MemfitError(f"no unit named {unknown[0]!r} in the profile; units: {names}")
    roles = []
    for j, name in enumerate(names):
        policy = policies.get(name, "none")
        if policy in profile.units[j].options:
            roles.append(Role(policy))
            continue
        span = segment_span(policy)
        if span is None or span[0] not in index or span[1] not in index:
            finer = [o for o in profile.units[j].options if o not in OPTIONS]
            raise MemfitError(
                f"unknown policy {policy!r} for unit {name!r}; use none, full, segment:<first>..<last>"
                + (f" or one of its measured options {', '.join(finer)}" if finer else
                   " (finer options need a profile made with granularity 'fine')")
            )
        role = Role(SEGMENT, index[span[0]], index[span[1]])
        if not role.first <= j <= role.last or role.last - role.first < 1:
            raise MemfitError(f"unit {name!r} is not inside its segment {'..'.join(span)!r} "
                              "(a segment spans two or more units)")
        roles.append(role)
    for role in roles:
        if role.kind == SEGMENT and any(roles[m] != role for m in range(role.first, role.last + 1)):
            raise MemfitError(f"segment {role.policy(names)!r} must name every unit from {names[role.first]!r} "
                              f"to {names[role.last]!r}")
    if any(r.kind == SEGMENT for r in roles) and not profile.chain:
        raise MemfitError("segments need units that form a chain (each unit's output is the next one's only "
                          "input, as in nn.Sequential); this profile's units do not")
    return roles


def unit_costs(profile: Profile, j: int, role: Role) -> Costs:
    """Exact (float) costs of unit ``j`` in ``role``."""
    u = profile.units[j]
    if role.kind != SEGMENT:
        o = u.options[role.kind]
        return Costs(o.fwd_peak_bytes, o.stored_bytes, o.bwd_peak_bytes, o.bwd_end_bytes, o.recompute_s)
    full = u.options["full"]
    rng = profile.rng_state_bytes  # one RNG state per region, kept by its first unit
    head = j == role.first
    # a later member stashes no RNG state of its own (measured peak: one RNG state below full's)
    # and keeps no input; that input is freed only when the member has returned (see member_input)
    fwd = (full.fwd_peak_bytes - (0 if head else rng),
           full.stored_bytes - (0 if head else profile.units[j - 1].output_bytes + rng))
    if j < role.last:
        none = u.options["none"]
        return Costs(*fwd, none.bwd_peak_bytes, none.bwd_end_bytes - (rng if head else 0), full.recompute_s)
    back = rematerialised(profile, role)
    return Costs(*fwd, back + full.bwd_peak_bytes, back + full.bwd_end_bytes + rng, full.recompute_s)


def member_input(profile: Profile, j: int, role: Role) -> int:
    """Bytes of a later segment member's input, which ``unit_costs`` frees with its forward but
    the model's own loop drops only after the member returned: live in the gap after it. Never
    the step's peak (the member's own forward peak holds it too), so only the drawn levels show it."""
    return profile.units[j - 1].output_bytes if role.kind == SEGMENT and j > role.first else 0


def rematerialised(profile: Profile, role: Role) -> int:
    """Bytes the members before the last come back with when the segment's backward begins."""
    total = profile.rng_state_bytes * (role.last - role.first)
    for m in range(role.first, role.last):
        u = profile.units[m]
        total += u.options["none"].stored_bytes - u.options["full"].stored_bytes + u.output_bytes
    return total


def segment_roles(n: int, max_len: int) -> list[Role]:
    return [Role(SEGMENT, i, k) for i in range(n) for k in range(i + 1, min(n, i + max_len))]
