"""The policy language (memfit/policy.py): every spelling a schedule or profile has used parses to
one variant and prints back the same; what is no policy is refused, with the kinds it could be."""

import json
from pathlib import Path

import pytest

from memfit.policy import (
    DERIVE,
    DERIVE_ALL,
    DERIVE_PRODUCTS,
    DERIVE_PROJECTIONS,
    FULL,
    KEEP,
    KINDS_HELP,
    Children,
    Derive,
    PolicyError,
    Segment,
    Selective,
    as_policies,
    parse,
    read,
    spelt,
)

RELEASE = Path(__file__).parent / "fixtures" / "release"


@pytest.mark.parametrize(("text", "policy"), [
    ("none", KEEP),
    ("full", FULL),
    ("derive", DERIVE),
    ("derive:products", DERIVE_PRODUCTS),
    ("derive:projections", DERIVE_PROJECTIONS),
    ("derive:all", DERIVE_ALL),
    ("derive@mlp", Derive(0, "mlp")),
    ("derive:products@attn", Derive(1, "attn")),
    ("derive:all@mlp.0", Derive(3, "mlp.0")),
    ("derive:all/no-tail", Derive(3, tail=False)),
    ("derive/no-tail", Derive(0, tail=False)),
    ("child:mlp", Children((("mlp",),))),
    ("child:ln_2>mlp+ln_1>attn.qkv", Children((("ln_2", "mlp"), ("ln_1", "attn.qkv")))),
    ("child:a+b>c>d", Children((("a",), ("b", "c", "d")))),
    ("selective:gemm", Selective("gemm")),
    ("selective:gemm@attn", Selective("gemm", "attn")),
    ("selective:gemm@mlp.0", Selective("gemm", "mlp.0")),
    ("segment:h.0..h.3", Segment("h.0", "h.3")),
    ("segment:model.layers.1..model.layers.12", Segment("model.layers.1", "model.layers.12")),
])
def test_each_spelling_parses_to_one_variant_and_back(text, policy):
    assert parse(text) == policy
    assert str(policy) == text
    assert hash(parse(text)) == hash(policy)  # a profile's options are keyed by them


@pytest.mark.parametrize("text", ["", "keep", "Full", "child:", "child:a+", "child:a>>b", "selective:",
                                  "selective:@attn", "selective:gemm@", "segment:h.0", "segment:..h.1",
                                  "segment:h.0..", "derive:x", "full:h.0", "derive@", "derive:x@mlp",
                                  "none@mlp", "derive:all@mlp/no-tail", "derive:x/no-tail", "full/no-tail"])
def test_what_is_no_policy_is_refused(text):
    with pytest.raises(PolicyError, match=r"expected none, full|empty module"):
        parse(text)
    assert read(text) is None


def test_values_that_are_no_string_read_as_none():
    for value in (None, 3, ["full"], {"a": 1}):
        assert read(value) is None


def test_the_api_border_takes_values_or_their_spelling_and_files_get_the_spelling_back():
    policies = as_policies({"h.0": "full", "h.1": Children.of("mlp"), "h.2": "segment:h.2..h.3",
                            "h.3": Segment("h.2", "h.3")})
    assert policies == {"h.0": FULL, "h.1": Children((("mlp",),)), "h.2": Segment("h.2", "h.3"),
                        "h.3": Segment("h.2", "h.3")}
    assert spelt(policies) == {"h.0": "full", "h.1": "child:mlp", "h.2": "segment:h.2..h.3", "h.3": "segment:h.2..h.3"}
    assert list(spelt(policies)) == list(policies)  # the units' order, which a schedule keeps
    with pytest.raises(PolicyError, match="'sometimes' is not a policy"):
        as_policies({"h.0": "sometimes"})
    for value in (3, ["full"]):
        with pytest.raises(PolicyError, match=r"'h\.0' has .*, which is no policy"):
            as_policies({"h.0": value})


def test_predict_takes_policies_as_values_or_as_a_schedule_file_spells_them():
    import memfit

    from .conftest import random_profile

    prof = random_profile(4, 1, fine=1)
    spelled = {"u0": "full", "u1": "child:c0", "u2": "none"}
    values = {u: memfit.parse_policy(p) for u, p in spelled.items()}
    assert all(isinstance(p, memfit.Policy) for p in values.values())
    assert memfit.predict(prof, spelled) == memfit.predict(prof, values)
    with pytest.raises(memfit.PolicyError, match="'partial' is not a policy"):
        memfit.predict(prof, {"u0": "partial"})


def test_the_kinds_help_names_every_variant():
    for kind in ("none", "full", "child:", "selective:", "derive", "derive[:<level>]@<child>", "segment:"):
        assert kind in KINDS_HELP


def test_every_policy_the_release_wrote_round_trips():
    """Each policy in the release's schedules and each option in its profiles parses, prints
    back unchanged and says in words what it recomputes."""
    seen = set()
    for path in RELEASE.parent.glob("**/*.json"):
        data = json.loads(path.read_text())
        texts = list(data.get("policies", {}).values())
        texts += [o for u in data.get("units", []) for o in u.get("options", {})]
        texts += [p for f in data.get("fallbacks", []) for p in f["policies"].values()]
        for text in texts:
            assert str(parse(text)) == text, path
            assert parse(text).describe(), text
            seen.add(type(parse(text)).__name__)
    assert seen == {"Keep", "Full", "Children", "Selective", "Derive", "Segment"}


def test_describe_says_what_is_recomputed():
    assert parse("child:ln_1>attn+mlp").describe() == "only ln_1→attn, mlp"
    assert parse("selective:gemm@attn").describe() == "attn: all but gemm outputs"
    assert parse("segment:h.0..h.2").describe() == "segment h.0..h.2, at once"
    assert KEEP.describe() == "-" and FULL.describe() == "the whole unit"
