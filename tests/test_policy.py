"""The policy language (memfit/policy.py): every spelling a schedule or profile has used parses to
one variant and prints back the same; what is no policy is refused, with the kinds it could be."""

import json
from pathlib import Path

import pytest

from memfit.policy import (
    DERIVE,
    DERIVE_PRODUCTS,
    FULL,
    KEEP,
    KINDS_HELP,
    Children,
    PolicyError,
    Segment,
    Selective,
    is_option,
    is_segment,
    parse,
    read,
)

RELEASE = Path(__file__).parent / "fixtures" / "release"


@pytest.mark.parametrize(("text", "policy"), [
    ("none", KEEP),
    ("full", FULL),
    ("derive", DERIVE),
    ("derive:products", DERIVE_PRODUCTS),
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
    assert is_segment(text) == isinstance(policy, Segment)
    assert is_option(text) == (not isinstance(policy, Segment))


@pytest.mark.parametrize("text", ["", "keep", "Full", "child:", "child:a+", "child:a>>b", "selective:",
                                  "selective:@attn", "selective:gemm@", "segment:h.0", "segment:..h.1",
                                  "segment:h.0..", "derive:x", "full:h.0"])
def test_what_is_no_policy_is_refused(text):
    with pytest.raises(PolicyError, match=r"expected none, full|empty module"):
        parse(text)
    assert read(text) is None and not is_option(text) and not is_segment(text)


def test_values_that_are_no_string_read_as_none():
    for value in (None, 3, ["full"], {"a": 1}):
        assert read(value) is None


def test_the_kinds_help_names_every_variant():
    for kind in ("none", "full", "child:", "selective:", "derive", "segment:"):
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
