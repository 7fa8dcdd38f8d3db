"""planning/roles.py on its own: policies and roles are each other's inverse, a wrong policy is
refused with what would be right, and a segment's composed costs hold the step's books."""

import pytest

from memfit import policy
from memfit.errors import MemfitError
from memfit.planning.roles import FULL, NONE, member_input, policies_of, roles_of, segment, unit_costs
from memfit.policy import parse

from .conftest import random_profile
from .test_optimizer import assignments


def test_policies_and_roles_are_inverse():
    prof = random_profile(6, 3)
    names = prof.unit_names
    for roles in assignments(6, 4):
        assert roles_of(prof, policies_of(names, roles)) == roles
    assert roles_of(prof, {}) == [NONE] * 6  # a unit not named keeps everything


@pytest.mark.parametrize(("policies", "message"), [
    ({"u9": policy.FULL}, "no unit named 'u9'"),
    ({"u0": parse("child:a")}, r"unknown policy 'child:a' for unit 'u0'; use none, full, segment:<first>..<last> "
                        r"\(finer options need a profile made with granularity 'fine'\)"),
    ({"u0": parse("segment:u1..u2")}, "'u0' is not inside its segment 'u1..u2'"),
    ({"u1": parse("segment:u1..u1")}, "a segment spans two or more units"),
    ({"u1": parse("segment:u1..u3"), "u2": parse("segment:u1..u3")}, "must name every unit from 'u1' to 'u3'"),
])
def test_a_wrong_policy_says_what_is_right(policies, message):
    with pytest.raises(MemfitError, match=message):
        roles_of(random_profile(5, 0), policies)


def test_a_fine_profile_lists_its_options_in_the_refusal():
    with pytest.raises(MemfitError, match=r"or one of its measured options child:c0, child:c1"):
        roles_of(random_profile(3, 0, fine=2), {"u1": parse("child:nope")})


def test_segments_need_a_chain():
    prof = random_profile(4, 0, chain=False)
    with pytest.raises(MemfitError, match="segments need units that form a chain"):
        roles_of(prof, {"u0": parse("segment:u0..u1"), "u1": parse("segment:u0..u1")})


@pytest.mark.parametrize("seed", range(5))
def test_a_segment_leaves_what_its_members_leave_uncheckpointed(seed):
    """Over the whole step a segment frees all it kept and rematerialised: its members' level
    changes add up to theirs without checkpointing (their gradients), as each unit's own do."""
    prof = random_profile(6, seed)
    for first, last in [(0, 1), (1, 4), (2, 5)]:
        seg = segment(first, last)
        members = range(first, last + 1)
        composed = sum(unit_costs(prof, j, seg).fwd_end + unit_costs(prof, j, seg).bwd_end for j in members)
        plain = sum(unit_costs(prof, j, NONE).fwd_end + unit_costs(prof, j, NONE).bwd_end for j in members)
        assert composed == plain
        # recomputed once each, as full recomputes them
        assert sum(unit_costs(prof, j, seg).recompute_s for j in members) == pytest.approx(
            sum(unit_costs(prof, j, FULL).recompute_s for j in members))
        # only later members hand their input over to the gap after them
        assert [member_input(prof, j, seg) > 0 for j in members] == [j > first for j in members]
