"""The policy language: what a schedule tells one unit to do, spelled and parsed here only.

An *option* is one way of running a unit that the profiler measures: ``none`` (keep
everything), ``full`` (checkpoint the unit), and with ``granularity="fine"`` ``child:...``
(checkpoint only some of its modules), ``nested:...`` (checkpoint the unit, and those modules
inside it again: two levels), ``selective:...`` (checkpoint under an *op set*: the ops whose
outputs are kept while the rest is recomputed) and ``derive`` (no checkpoint; cheap saved
tensors re-derived in the backward). A *segment* is not measured: several units in a
chain checkpointed as one region, planned from their measured ``none`` and ``full``. A unit's
*policy* in a schedule is one of its options or its membership of a segment; ``str(policy)``
is its JSON spelling (the one schedules and profiles have always used) and ``parse`` its inverse.
Text is parsed once, where it enters (the file loaders, the command line, ``as_policies`` at the
public API); inside memfit policies travel as these values.

    none  full  derive  derive:products  derive:projections  derive:all
    derive[:<level>]@<child>          derive on that child of the unit only
    child:<region>[+<region>...]      a region is a module, or a chain a>b (a feeds b), by relative name
    selective:<op set>[@<child>]      the unit, or only that child of it, under the op set
    nested:<region>[+<region>...]     the whole unit, and inside it those regions again
    segment:<first unit>..<last unit> every unit from first to last says the same
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from memfit.errors import PolicyError

SEGMENT_HELP = "segment:<first>..<last>"
KINDS_HELP = (f"none, full, child:<children>, nested:<children>, selective:<op set>, derive, derive:products, "
              f"derive:projections, derive:all, derive[:<level>]@<child>, derive[:<level>]/no-tail or "
              f"{SEGMENT_HELP}")


@dataclass(frozen=True, slots=True)
class Keep:
    """Keep every saved tensor (no checkpoint)."""

    def __str__(self) -> str:
        return "none"

    def describe(self) -> str:
        return "-"


@dataclass(frozen=True, slots=True)
class Full:
    """Checkpoint the whole unit: keep its input, recompute it in the backward."""

    def __str__(self) -> str:
        return "full"

    def describe(self) -> str:
        return "the whole unit"


@dataclass(frozen=True, slots=True)
class Children:
    """Checkpoint only these modules of the unit, each region on its own; a region of several
    modules is a chain (each feeds the next) checkpointed as one."""

    regions: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, names: str) -> Children:
        """``a+b>c`` -> regions (a,), (b, c): the part of ``child:a+b>c`` after the colon."""
        regions = tuple(tuple(part.split(">")) for part in names.split("+"))
        if not all(m for region in regions for m in region):
            raise PolicyError(f"child:{names} names an empty module")
        return cls(regions)

    def __str__(self) -> str:
        return "child:" + self.names

    @property
    def names(self) -> str:
        return "+".join(">".join(r) for r in self.regions)

    def describe(self) -> str:  # a chain (a>b) recomputes a, and b only where b holds more than one product
        return "only " + ", ".join("→".join(r) for r in self.regions)


@dataclass(frozen=True, slots=True)
class Nested:
    """Checkpoint the whole unit, and inside it these regions of its modules on their own (two
    levels, as ``torch.utils.checkpoint`` nests): the forward keeps the unit's input as ``full``
    does; the backward's recomputation of the unit keeps only what the regions leave out, and
    each region is recomputed again at its own backward. Less memory at the unit's backward than
    ``full``, for a second run of the regions' forward."""

    inner: Children

    def __str__(self) -> str:
        return "nested:" + self.inner.names

    def describe(self) -> str:
        return "the whole unit, then " + ", ".join("→".join(r) for r in self.inner.regions) + " again"


@dataclass(frozen=True, slots=True)
class Selective:
    """Checkpoint the unit, or only its module ``child``, keeping the outputs of op set ``ops``."""

    ops: str
    child: str = ""

    def __str__(self) -> str:
        return f"selective:{self.ops}" + (f"@{self.child}" if self.child else "")

    def describe(self) -> str:
        what = {"gemm": "all but gemm outputs", "weights": "all but weight-product outputs (core attention)"}.get(
            self.ops, f"op set {self.ops}")
        return f"{self.child}: {what}" if self.child else what


DERIVE_LEVELS = ("derive", "derive:products", "derive:projections", "derive:all")
NO_TAIL = "/no-tail"  # policy.Derive's tail left out
_DERIVE_SAYS = ("cheap ops whose saved outputs it re-derives (norms, activations, dropout)",
                "cheap ops, attention's q.k^T, softmax and dropout's draws: their saved outputs re-derived",
                "cheap ops, attention's projections, q.k^T, softmax, dropout's draws: saved outputs re-derived",
                "everything but P.v (products with weights, dropout's draws too): saved outputs re-derived")


@dataclass(frozen=True, slots=True)
class Derive:
    """No checkpoint: saved tensors that cheap ops can re-derive are dropped (runtime/derive.py).
    Each ``level`` re-runs more (``DERIVE_LEVELS``): 0 cheap ops; 1 (``products``) also a product
    of two activations that makes more than it takes and a softmax (written-out attention's
    probabilities from the q and k kept for its first product); 2 (``projections``) also products
    with a weight that make no more than they take and sum over no more than the block's width
    (attention's q, k, v and output projections from the norm's output, itself re-derived from
    the block's input); 3 (``all``) every product with a weight (an MLP's up- and down-projections
    too), so a block keeps little more than its input and
    attention's context, what torch.compile's partitioner keeps at budget 0.1. With ``child``,
    only what that module of the unit saves (``derive@mlp``: its activation's output from the
    product's it keeps; ``selective:gemm@mlp``'s choice at the hooks' cost, without SAC's
    dispatch mode over every op)."""

    level: int = 0
    child: str = ""
    # the model's last unit re-derives in the step after it too (final norm, head: runtime/derive.py's
    # tail); without (``derive:all/no-tail``) the head keeps what it saves, and the tail re-runs no
    # product of the unit's to re-make the unit's output for the final norm
    tail: bool = True

    def __post_init__(self) -> None:
        if self.level not in range(len(DERIVE_LEVELS)):
            raise PolicyError(f"derive has levels 0 to {len(DERIVE_LEVELS) - 1}, not {self.level!r}")
        if self.child and not self.tail:
            raise PolicyError(f"derive on a child ({self.child!r}) has no tail to leave out")

    def __str__(self) -> str:
        return DERIVE_LEVELS[self.level] + (f"@{self.child}" if self.child else "") + ("" if self.tail else NO_TAIL)

    def describe(self) -> str:
        if self.child:
            return f"{self.child}: {_DERIVE_SAYS[self.level]}"
        return _DERIVE_SAYS[self.level] + ("" if self.tail else "; the head keeps what it saves (no tail)")


@dataclass(frozen=True, slots=True)
class Segment:
    """Membership of the segment ``first..last``: those units checkpointed as one region."""

    first: str
    last: str

    def __str__(self) -> str:
        return f"segment:{self.first}..{self.last}"

    def describe(self) -> str:
        return f"segment {self.first}..{self.last}, at once"


Policy = Keep | Full | Children | Nested | Selective | Derive | Segment
Option = Keep | Full | Children | Nested | Selective | Derive  # what a profile measures
Policies = dict[str, Policy]  # unit -> its policy, in the model's order
KEEP, FULL = Keep(), Full()
DERIVES = tuple(Derive(k) for k in range(len(DERIVE_LEVELS)))
DERIVE, DERIVE_PRODUCTS, DERIVE_PROJECTIONS, DERIVE_ALL = DERIVES
COARSE: tuple[Option, Option] = (KEEP, FULL)  # the options measured for every unit
_PLAIN: dict[str, Policy] = {str(p): p for p in (KEEP, FULL, DERIVE, DERIVE_PRODUCTS, DERIVE_PROJECTIONS, DERIVE_ALL)}


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Policy:
    """The policy ``text`` spells; PolicyError if it spells none."""
    if not isinstance(text, str):
        raise PolicyError(f"{text!r} is not a string")
    if text in _PLAIN:
        return _PLAIN[text]
    untailed = text.removesuffix(NO_TAIL)
    if untailed != text and untailed in DERIVE_LEVELS:
        return Derive(DERIVE_LEVELS.index(untailed), tail=False)
    kind, sep, rest = text.partition(":")
    if sep and kind == "child":
        return Children.of(rest)
    if sep and kind == "nested":
        return Nested(Children.of(rest))
    if sep and kind == "selective":
        ops, _, child = rest.partition("@")
        if ops and (child or "@" not in rest):
            return Selective(ops, child)
    level, at, child = text.partition("@")
    if at and child and level in DERIVE_LEVELS and not child.endswith(NO_TAIL):  # a child has no tail
        return Derive(DERIVE_LEVELS.index(level), child)
    if sep and kind == "segment":
        first, dots, last = rest.partition("..")
        if first and dots and last:
            return Segment(first, last)
    raise PolicyError(f"{text!r} is not a policy; expected {KINDS_HELP}")


def read(text: object) -> Policy | None:
    """``parse``, or None where ``text`` is no policy."""
    try:
        return parse(text)  # type: ignore[arg-type]
    except (PolicyError, TypeError):  # TypeError: an unhashable value (a list in a hand-edited file)
        return None


def spelt(policies: Mapping[str, Policy]) -> dict[str, str]:
    """Each unit's policy as files and tables spell it."""
    return {unit: str(p) for unit, p in policies.items()}


def as_policies(policies: Mapping[str, Policy | str]) -> dict[str, Policy]:
    """Each unit's policy as a value: the public API's border (``predict``), where a user may
    spell them as a schedule file does (``{"h.0": "full"}``)."""
    out: dict[str, Policy] = {}
    for unit, p in policies.items():
        if isinstance(p, str):
            out[unit] = parse(p)
        elif isinstance(p, Policy):  # type: ignore[arg-type]  # a union of classes: isinstance takes it
            out[unit] = p
        else:
            raise PolicyError(f"unit {unit!r} has {p!r}, which is no policy; expected one of memfit.policy's values "
                              f"or its spelling: {KINDS_HELP}")
    return out
