"""A unit's learned ``derive`` plan: what one forward under the watch decided, by position, so
that later forwards re-derive the same tensors with no dispatch mode, paying per saved tensor.

The first training forward of a unit for each input signature runs under runtime/derive.py's
watch. It records, for every tensor autograd packs, in order, its layout and whether it is kept
or re-derived, and for a re-derived one a ``Template``: the op and its inputs named by position,
never by tensor: an earlier packed tensor (a *slot*: autograd keeps it), a parameter or buffer
of the unit, constants, or another template. Every later forward binds those positions to its
own tensors (``Bind``); the learning forward does the same, so both run one code path.

A forward is trusted to be the learned one only as far as it shows it: each packed tensor must
have the learned layout, and each tensor handed over as re-derived the learned autograd history
(the graph nodes from it back to the recipe's inputs, matched by identity with the bound slots
and parameters). A forward that differs (data-dependent control flow, other parameters) keeps
what it cannot vouch for, and the unit learns again.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.errors import MemfitError
from memfit.measure.host import Work, timed
from memfit.runtime.derive_rng import Fill, RngAt, digest

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset
# an op's arguments, flat: per positional argument and per keyword, None for one value or the
# length of a list of tensors (ATen takes tensors at the top level or in a list there)
Spec = tuple[tuple[int | None, ...], tuple[str, ...], tuple[int | None, ...]]


def geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), t.stride(), t.storage_offset()


@dataclass(slots=True, frozen=True)
class Leaf:
    """A tensor input of a template: packed tensor number ``index`` (``param`` False) or the
    unit's parameter or buffer number ``index``, seen through ``view`` (None: as it is)."""

    param: bool
    index: int
    view: Geometry | None


@dataclass(slots=True, frozen=True)
class SubRef:
    """An input made again itself: ``template``'s output seen through ``view``."""

    template: Template
    view: Geometry


@dataclass(slots=True, eq=False)
class Template:
    """How to make one tensor again: an op, its arguments' tree with tensors as ``Leaf`` or
    ``SubRef``, the output's layout, how deep its chain of templates goes, and every ``Leaf`` of
    that chain in order (``Bind.leaves`` reads them on every forward)."""

    func: Any
    spec: Spec
    args: list[Any]  # flat: ``_rebuild`` makes (args, kwargs) of them
    out: Geometry
    depth: int
    leaves: tuple[Leaf, ...] = ()


@dataclass(slots=True, frozen=True)
class Step:
    """One packed tensor as learned: its layout and dtype; ``bind`` when a template names it;
    ``derive`` (the template, the view of its output that was saved, the autograd history, which
    of its outputs) when it is re-derived."""

    layout: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: torch.dtype
    bind: bool = False
    derive: tuple[Template, Geometry, Any, int] | None = None


@dataclass(slots=True)
class Plan:
    """A unit's forward as learned: every packed tensor in order, the bytes it re-derives, where
    to find the parameters and buffers its templates name (by number; a module held weakly, the
    dict, the name) among the unit's ``n_params``, and after how many packed tensors the
    generator's state is taken (``RngAt``: the fills' only cost in the forward)."""

    steps: list[Step]
    derived_bytes: int
    n_params: int
    params: dict[int, tuple[Any, str, str]]
    rng_at: dict[int, torch.device] = field(default_factory=dict)  # RngAt.packs -> the generator's device


class Recipe:
    """One forward's instance of a template: the op, its inputs bound, the versions the inputs
    had when bound. Views of one storage saved by several nodes share the recomputed base: held
    from its first use until every saved view of it was unpacked (so the probabilities, saved by
    the softmax and by the product with V, are made once); an input that several recipes take is
    held until each of them was made (a fused qkv product, run once for q, k and v's copies). A
    norm's statistics are its later outputs: one run makes them with the output, each held while
    a saved view of it waits (``index``)."""

    __slots__ = ("__weakref__", "args", "bases", "func", "held", "out", "versions", "waiting")

    def __init__(self, func: Any, args: Any, out: Geometry, versions: list[tuple[torch.Tensor, int]]) -> None:
        self.func, self.args, self.out, self.versions = func, args, out, versions
        self.bases: list[Any] = []  # weak references to the made outputs, while someone holds them
        self.held: list[torch.Tensor | None] = []
        self.waiting = [0]  # per output: saved views not unpacked yet

    @property
    def pending(self) -> int:
        return sum(self.waiting)

    def hold(self, index: int = 0) -> None:
        """One more saved view (or recipe) waits for output ``index``."""
        self.waiting += [0] * (index + 1 - len(self.waiting))
        self.waiting[index] += 1

    def make(self, index: int = 0) -> torch.Tensor:
        base = self.held[index] if index < len(self.held) else None
        if base is None and index < len(self.bases) and self.bases[index] is not None:
            base = self.bases[index]()
        if base is None:
            for t, v in self.versions:
                if t._version != v:
                    raise MemfitError(
                        f"an input of {self.func} that memfit re-derives in the backward was changed in place "
                        "after the forward used it; plan this unit without the derive option")
            with Work():  # the option's own work, which the profiler prices it from
                args, kwargs = _rebuild([unpack(a) for a in self.args[0]], self.args[1])
                out = self.func(*args, **kwargs)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if (tuple(outs[0].shape), outs[0].stride()) != self.out[:2]:
                raise MemfitError(f"{self.func} re-derived a tensor of another layout; plan without derive")
            self.bases = [weakref.ref(o) if isinstance(o, torch.Tensor) else None for o in outs]
            self.held = [o if k < len(self.waiting) and self.waiting[k] > 0 else None for k, o in enumerate(outs)]
            base = outs[index]
        elif index < len(self.waiting) and self.waiting[index] > 0:
            self.held += [None] * (index + 1 - len(self.held))
            self.held[index] = base
        return base

    def unpacked(self, index: int = 0) -> None:
        self.waiting[index] -= 1
        if self.waiting[index] <= 0 and index < len(self.held):
            self.held[index] = None


class Derived:
    """What autograd holds instead of a re-derived tensor (or an input of another recipe): output
    ``index`` of its recipe, seen through ``view``; each counts once in its recipe's waiting."""

    __slots__ = ("index", "recipe", "view")

    def __init__(self, recipe: Recipe, view: Geometry, index: int = 0) -> None:
        self.recipe, self.view, self.index = recipe, view, index

    def unpack(self) -> torch.Tensor:
        size, stride, offset = self.view
        out = self.recipe.make(self.index).as_strided(size, stride, offset)
        self.recipe.unpacked(self.index)  # a saved view unpacked, or an input taken by the recipe that needed it
        return out


class _View:
    __slots__ = ("t", "view")

    def __init__(self, t: torch.Tensor, view: Geometry) -> None:
        self.t, self.view = t, view

    def unpack(self) -> torch.Tensor:
        return self.t.as_strided(*self.view)


def unpack(obj: Any) -> Any:
    return obj.unpack() if isinstance(obj, (Derived, _View)) else obj


def unpack_hook(obj: Any) -> Any:
    """The unpack hook: ``unpack``, timed as the option's own work (measure/host.Work)."""
    return timed(unpack, obj)


@dataclass(slots=True)
class Bind:
    """One forward's binding of a plan's positions: the packed tensors templates name, the
    unit's parameters and buffers as this call sees them, and the recipes made so far."""

    params: list[Any]  # None where no template of the plan takes the parameter
    slots: dict[int, torch.Tensor] = field(default_factory=dict)
    recipes: dict[int, Recipe] = field(default_factory=dict)  # id(template) -> its recipe
    rng: dict[int, torch.Tensor] = field(default_factory=dict)  # RngAt.packs -> the state taken then
    after: dict[int, int] = field(default_factory=dict)  # id(a Fill's template) -> digest at its noise's pack

    def recipe(self, template: Template) -> Recipe | None:
        """The template's recipe in this forward (made once), or None when a slot it names was
        not bound (the forward did not pack it)."""
        made = self.recipes.get(id(template))
        if made is not None:
            return made
        args: list[Any] = []
        versions: list[tuple[torch.Tensor, int]] = []
        for a in template.args:
            if isinstance(a, Leaf):
                t = self.params[a.index] if a.param else self.slots.get(a.index)
                if t is None:
                    return None
                if not a.param:
                    versions.append((t, t._version))  # as the op found it
                a = t if a.view is None else _View(t, a.view)
            elif isinstance(a, SubRef):
                sub = self.recipe(a.template)
                if sub is None:
                    return None
                a = Derived(sub, a.view)
                sub.hold()  # until this recipe has made its tensor
            elif isinstance(a, RngAt):
                a = self.rng.get(a.packs)
                if a is None:
                    return None
            args.append(a)
        func = template.func
        if isinstance(func, Fill):
            func = functools.partial(func, after=self.after.get(id(template)))
        made = self.recipes[id(template)] = Recipe(func, (args, template.spec), template.out, versions)
        return made

    def packed_recipe(self, template: Template) -> Recipe | None:
        """``recipe`` for the template of a tensor being packed now; a fill's noise is packed right
        after its draw, so the generator's state now is the one its re-draw must end at."""
        if isinstance(template.func, Fill):
            self.after[id(template)] = digest(template.func.device)
        return self.recipe(template)

    def release(self, template: Template) -> None:
        """Undo ``recipe(template)`` where the forward kept the tensor after all (its history was
        not the plan's): a recipe no saved view holds is forgotten, and the sub-recipes it counted
        on are let go, so a shared input (a fused qkv) is not held for it to the graph's end."""
        made = self.recipes.get(id(template))
        if made is None or made.pending > 0:
            return
        del self.recipes[id(template)]
        for a, ref in zip(made.args[0], template.args, strict=True):
            if isinstance(a, Derived):
                a.recipe.unpacked()
                self.release(ref.template)

    def leaves(self, template: Template) -> list[torch.Tensor]:
        """The bound tensors a template's tree takes, in a fixed order (for ``history``)."""
        params, slots = self.params, self.slots
        found = (params[a.index] if a.param else slots.get(a.index) for a in template.leaves)
        return [t for t in found if t is not None]


def history(t: torch.Tensor, leaves: list[torch.Tensor], depth: int) -> Any:
    """``t``'s autograd history back to ``leaves``: node class names, with each edge that reaches
    a leaf named by the leaf's number, ``depth`` nodes deep. Equal histories say the same ops made
    ``t`` from the same inputs."""
    fns: list[Any] = []  # held while the ids below stand for them
    by_node: dict[tuple[int, int], int] = {}  # (a leaf's grad_fn, its output number) -> the leaf's number
    by_var: dict[int, int] = {}  # a leaf that autograd accumulates into -> its number
    for i, s in enumerate(leaves):
        fn = s.grad_fn
        if fn is not None:
            fns.append(fn)
            by_node.setdefault((id(fn), s.output_nr), i)
        elif s.requires_grad:
            by_var.setdefault(id(s), i)
    return _node(t.grad_fn, by_node, by_var, depth)


# the same op recorded under two names: ``reshape`` of a tensor that is not contiguous records
# ``_reshape_alias`` in eager mode and ``view`` under a Python dispatch mode (the learning forward's
# watch), where ATen takes its composite path (``at::isTensorSubclassLike``): one view either way
_SAME_NODE = {"ReshapeAliasBackward0": "ViewBackward0"}


def _name(node: Any) -> str:
    name = type(node).__name__
    return _SAME_NODE.get(name, name)


def _node(node: Any, by_node: dict[tuple[int, int], int], by_var: dict[int, int], depth: int) -> Any:
    if node is None:
        return None
    edges: list[Any] = []
    for nxt, nr in node.next_functions:
        if nxt is None:
            edges.append(None)
            continue
        name = _name(nxt)
        if name == "AccumulateGrad":
            hit = by_var.get(id(nxt.variable)) if by_var else None
        else:
            hit = by_node.get((id(nxt), nr))
        if hit is not None:
            edges.append(hit)
        elif depth > 0:
            edges.append(_node(nxt, by_node, by_var, depth - 1))
        else:
            edges.append(name)
    return _name(node), tuple(edges)


def template_of(recipe: Any, memo: dict[int, Template], slot_of: dict[int, tuple[int, torch.Tensor]],
                param_of: dict[int, tuple[int, torch.Tensor]], key: Any) -> Template | None:
    """A learning forward's recipe (runtime/derive_watch.py's ``_Recipe``) as a template, its tensors
    named by position: ``slot_of``/``param_of`` map a storage to (position, the tensor there).
    None when an input is neither (then the tensor is kept, in this forward and every later one)."""
    made = memo.get(id(recipe))
    if made is not None:
        return made
    leaves, spec = _flatten(*recipe.args)
    args: list[Any] = []
    depth = 0
    for a in leaves:
        if isinstance(a, torch.Tensor):
            k = key(a)
            param = k in param_of
            found = param_of.get(k) or slot_of.get(k)
            if found is None or found[1].dtype != a.dtype:
                return None
            whole = geometry(a) == geometry(found[1])
            a = Leaf(param, found[0], None if whole else geometry(a))
        elif hasattr(a, "recipe") and hasattr(a, "size"):  # a sub-recipe's output (derive_watch._Derived)
            sub = template_of(a.recipe, memo, slot_of, param_of, key)
            if sub is None:
                return None
            depth = max(depth, sub.depth + 1)
            a = SubRef(sub, (a.size, a.stride, a.offset))
        args.append(a)
    leaves_of = tuple(x for a in args for x in ((a,) if isinstance(a, Leaf) else
                                                  a.template.leaves if isinstance(a, SubRef) else ()))
    made = memo[id(recipe)] = Template(recipe.func, spec, args, recipe.geometry, depth, leaves_of)
    return made


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Spec]:
    """An op's arguments as a flat list and what ``_rebuild`` needs to put them back (cheaper
    than pytree, which also takes apart the lists of ints such as a norm's shape)."""
    flat: list[Any] = []

    def one(a: Any) -> int | None:
        if isinstance(a, (list, tuple)) and any(not isinstance(x, (int, float, bool, type(None))) for x in a):
            flat.extend(a)
            return len(a)
        flat.append(a)
        return None

    pos = tuple(one(a) for a in args)
    names = tuple(kwargs)
    return flat, (pos, names, tuple(one(kwargs[n]) for n in names))


def _rebuild(flat: list[Any], spec: Spec) -> tuple[list[Any], dict[str, Any]]:
    pos, names, kws = spec
    i = 0
    args: list[Any] = []
    for n in pos:
        if n is None:
            args.append(flat[i])
            i += 1
        else:
            args.append(flat[i : i + n])
            i += n
    kwargs: dict[str, Any] = {}
    for name, n in zip(names, kws, strict=True):
        if n is None:
            kwargs[name] = flat[i]
            i += 1
        else:
            kwargs[name] = flat[i : i + n]
            i += n
    return args, kwargs
