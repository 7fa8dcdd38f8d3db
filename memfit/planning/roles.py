"""What each unit does in a schedule (its role) and what that costs, from a Profile.

A role is one of the unit's measured options (``none``, ``full``, or a finer one; see
memfit/policy.py), costed as measured, or membership of a segment ``i..k``: units i to k
checkpointed as one region that keeps only unit i's input and rematerialises the whole region
when the gradient reaches unit k. A role is a policy with the segment's ends as unit indices.

Segment memory is composed from the two measured options: a member runs its forward as if
checkpointed and its inner outputs are freed at once; at unit k's backward the members before
k come back as they were without checkpointing, then k recomputes and runs backward; the
members before k then run backward as kept units. A region keeps one RNG state (on the CPU),
where checkpointing each member alone keeps one each. Its time: the last member's is ``full``'s,
each earlier member's its own measured ``member_s`` (UnitProfile), dearer than ``full``'s where a
recompute right before its own backward leaves that backward its tensors in the cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.formats.profile import Profile
from memfit.policy import COARSE, KEEP, SEGMENT_HELP, Option, Policy, Segment
from memfit.policy import FULL as CHECKPOINT

# The planner weighs a cost as its estimate plus one standard error (an uncertainty is two): the
# cheapest-looking of many noisy estimates is, on average, one that came out low (the winner's
# curse), so an option priced from thin evidence must win by more than its noise to be taken.
RISK = 0.5


def weighed(recompute_s: float, uncertainty_s: float) -> float:
    """What the planner minimises for a cost of ``recompute_s`` known to ``uncertainty_s``."""
    return recompute_s + RISK * uncertainty_s


@dataclass(frozen=True, slots=True)
class Role:
    option: Option | None  # the measured option (none, full, child:mlp, ...); None for a segment's member
    first: int = -1  # a segment's first and last unit
    last: int = -1

    @property
    def is_segment(self) -> bool:
        return self.option is None

    def policy(self, names: list[str]) -> Policy:
        return Segment(names[self.first], names[self.last]) if self.option is None else self.option


def segment(first: int, last: int) -> Role:
    """Membership of the segment of units ``first`` to ``last``."""
    return Role(None, first, last)


NONE, FULL = Role(KEEP), Role(CHECKPOINT)


@dataclass(frozen=True, slots=True)
class Costs:
    """One unit's phases under one role: (peak, end) of forward, of its first backward and of a
    later one (gradients accumulating: profile.OptionCost.backward), and time."""

    fwd_peak: int | float
    fwd_end: int | float
    bwd_peak: int | float
    bwd_end: int | float
    recompute_s: float
    later_bwd_peak: int | float
    later_bwd_end: int | float
    release: int | float = 0  # freed on leaving autocast (profile.OptionCost.release_bytes)
    uncertainty_s: float = 0.0  # how sure recompute_s is (profile.OptionCost.recompute_uncertainty_s)
    freed: int | float = 0  # freed at the end of the remainder after its forward (profile.OptionCost.freed_after_bytes)
    # freed at the end of the remainder after the next unit's forward (profile.OptionCost.freed_later_bytes);
    # segment members never count it (cautious: kept until the step's end, as before it was measured)
    later: int | float = 0
    # added to the peak of the remainder after its forward (profile.OptionCost.after_peak_bytes)
    after_peak: int | float = 0
    # keeps tensors made outside the units past the forward (profile.OptionCost.holds_outside): with
    # any such unit the remainders take their checkpointed figures (Phase.ckpt_end_bytes, peak_with)
    holds: bool = True

    def backward(self, later: bool) -> tuple[int | float, int | float]:
        return (self.later_bwd_peak, self.later_bwd_end) if later else (self.bwd_peak, self.bwd_end)


def policies_of(names: list[str], roles: list[Role]) -> dict[str, Policy]:
    """Each unit's policy: the inverse of ``roles_of``."""
    return {n: r.policy(names) for n, r in zip(names, roles, strict=True)}


def roles_of(profile: Profile, policies: Mapping[str, Policy]) -> list[Role]:
    """Each unit's role; units not named are ``none``. Segments must be contiguous and whole."""
    names = profile.unit_names
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in policies if n not in index]
    if unknown:
        raise MemfitError(f"no unit named {unknown[0]!r} in the profile; units: {names}")
    roles = []
    for j, name in enumerate(names):
        policy = policies.get(name, KEEP)
        if policy in profile.units[j].options:
            roles.append(Role(policy))  # type: ignore[arg-type]
            continue
        if not isinstance(policy, Segment) or policy.first not in index or policy.last not in index:
            finer = [str(o) for o in profile.units[j].options if o not in COARSE]
            raise MemfitError(
                f"unknown policy {str(policy)!r} for unit {name!r}; use none, full, {SEGMENT_HELP}"
                + (f" or one of its measured options {', '.join(finer)}" if finer else
                   " (finer options need a profile made with granularity 'fine')")
            )
        role = segment(index[policy.first], index[policy.last])
        if not role.first <= j <= role.last or role.last - role.first < 1:
            raise MemfitError(f"unit {name!r} is not inside its segment {policy.first + '..' + policy.last!r} "
                              "(a segment spans two or more units)")
        roles.append(role)
    for role in roles:
        if role.is_segment and any(roles[m] != role for m in range(role.first, role.last + 1)):
            raise MemfitError(f"segment {str(role.policy(names))!r} must name every unit from {names[role.first]!r} "
                              f"to {names[role.last]!r}")
    if any(r.is_segment for r in roles) and not profile.segmentable:
        if profile.chain:
            raise MemfitError("segments are not planned for steps under autocast (amp-*) yet: the weight casts a "
                              "segment's recompute holds are not measured; checkpoint its units one by one")
        raise MemfitError("segments need units that form a chain (each unit's output is the next one's only "
                          "input, as in nn.Sequential); this profile's units do not")
    return roles


def unit_costs(profile: Profile, j: int, role: Role) -> Costs:
    """Exact (float) costs of unit ``j`` in ``role``."""
    u = profile.units[j]
    if role.option is not None:
        o = u.options[role.option]
        return Costs(o.fwd_peak_bytes, o.stored_bytes, o.bwd_peak_bytes, o.bwd_end_bytes, o.recompute_s,
                     *o.backward(later=True), o.release_bytes, o.recompute_uncertainty_s, o.freed_after_bytes,
                     o.freed_later_bytes, o.after_peak_bytes + kept_after(o.freed_after_bytes),
                     role != NONE and o.holds_outside)
    full = u.options[CHECKPOINT]
    rng = profile.rng_state_bytes  # one RNG state per region, kept by its first unit
    head = j == role.first
    # a later member stashes no RNG state of its own (measured peak: one RNG state below full's)
    # and keeps no input; that input is freed only when the member has returned (see member_input)
    fwd = (full.fwd_peak_bytes - (0 if head else rng),
           full.stored_bytes - (0 if head else profile.units[j - 1].output_bytes + rng))
    if j < role.last:
        none = u.options[KEEP]
        (p0, e0), (p1, e1) = none.backward(False), none.backward(True)
        head_rng = rng if head else 0
        measured = u.member_s is not None
        return Costs(*fwd, p0, e0 - head_rng, u.member_s if measured else full.recompute_s, p1, e1 - head_rng,
                     full.release_bytes, u.member_uncertainty_s if measured else full.recompute_uncertainty_s,
                     full.freed_after_bytes, after_peak=kept_after(full.freed_after_bytes))
    back = rematerialised(profile, role)
    (p0, e0), (p1, e1) = full.backward(False), full.backward(True)
    return Costs(*fwd, back + p0, back + e0 + rng, full.recompute_s, back + p1, back + e1 + rng, full.release_bytes,
                 full.recompute_uncertainty_s, full.freed_after_bytes, after_peak=kept_after(full.freed_after_bytes))


def kept_after(freed: int | float) -> int | float:
    """What an option that frees a negative amount after its unit (a checkpoint keeping the unit's
    input, which the plain step frees there: profile.OptionCost.freed_after_bytes) adds to that
    remainder's peak: it lands at the remainder's end, but the plain step may free it before
    the peak (cautious where it frees it after)."""
    return max(0, -freed)


def member_input(profile: Profile, j: int, role: Role) -> int:
    """Bytes of a later segment member's input, which ``unit_costs`` frees with its forward but
    the model's own loop drops only after the member returned: live in the gap after it. Never
    the step's peak (the member's own forward peak holds it too), so only the drawn levels show it."""
    return profile.units[j - 1].output_bytes if role.is_segment and j > role.first else 0


def rematerialised(profile: Profile, role: Role) -> int:
    """Bytes the members before the last come back with when the segment's backward begins."""
    total = profile.rng_state_bytes * (role.last - role.first)
    for m in range(role.first, role.last):
        u = profile.units[m]
        total += u.options[KEEP].stored_bytes - u.options[CHECKPOINT].stored_bytes + u.output_bytes
    return total


def segment_roles(n: int, max_len: int) -> list[Role]:
    return [segment(i, k) for i in range(n) for k in range(i + 1, min(n, i + max_len))]
