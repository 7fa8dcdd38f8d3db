"""Which finer options to measure for each unit: its children worth checkpointing alone, cheap
chains, ``derive`` (cheap saved tensors re-derived in the backward, runtime/derive.py) on the
whole unit where it frees ``MIN_SHARE`` and on each of those children (``derive@<child>``, where
the gemm op set was offered before: it keeps no more, at the hooks' cost), and the op sets only
where no ``derive`` level past cheap ops is offered on the same module (``derive:products`` keeps
the products and re-runs the rest, dropout's draws included, as ``selective:weights`` does).

A **chain** is a cheap producer (a module with no weight matrix: a norm, an activation) whose
output only the next product saves (``ln_2>mlp.0``, ``mlp.1>mlp.2``): checkpointed as one region
it costs only the producer's recomputation (see runtime/regions.py) and frees its output, what
the compilers' partitioners recompute first. Every unit with chains is offered all of them at
once, and each child option takes the chains outside that child along, with its own producer
in front (``child:ln_1>attn+ln_2>mlp.0+mlp.1>mlp.2``).

A child is a candidate when it has parameters (it computes something dear enough to be worth
keeping the rest of the unit) and makes at least ``MIN_SHARE`` of the bytes the unit saves for
backward (checkpointing it can free something). Units of one class and parameter shapes share
the choice, made once on the first of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from memfit import policy
from memfit.errors import MemfitError, PolicyError
from memfit.measure.inputs import Inputs
from memfit.measure.step import LossFn, packed, storage_key
from memfit.policy import DERIVE, DERIVE_ALL, DERIVE_PRODUCTS, DERIVES, Children, Nested, Option, Selective
from memfit.profiler.saved import unit_facts
from memfit.runtime.derive import Derive
from memfit.runtime.derive_watch import ACTIVATION_PRODUCTS
from memfit.runtime.op_sets import GEMM, WEIGHTS
from memfit.torch_private import TorchDispatchMode

MIN_SHARE = 0.1  # of the unit's saved bytes
MIN_MORE = 0.01  # of the unit's saved bytes, beyond an option offered already
MAX_CHILDREN = 3  # child options per unit class, the largest savers first
CHILD_DERIVES = (DERIVE, DERIVE_PRODUCTS)  # the levels tried on a child (deeper ones: on the whole unit)


def fine_options(model: nn.Module, names: list[str], inputs: Inputs, loss_fn: LossFn,
                 unit_saved: list[int], children: list[str] | None = None) -> dict[str, list[Option]]:
    """Unit name -> its finer options (``child:<chains>``, ``child:<name>[+<chains>]``,
    ``nested:<the child options' regions that do not overlap>``, ``derive[:products]@<name>``,
    ``selective:gemm`` (where no child stands out), ``selective:weights[@<name>]`` (both where
    ``derive:products`` is not offered on that module), ``derive``, ``derive:products``,
    ``derive:projections``, ``derive:all``; the last unit also ``derive:all/no-tail``), in a fixed order.
    ``children`` (relative module names, ``a+b`` for several at once) replaces the automatic
    choice of children; a unit without one of them is not offered it."""
    out: dict[str, list[Option]] = {}
    chosen: dict[tuple[object, ...], list[Option]] = {}
    for j, name in enumerate(names):
        unit = model.get_submodule(name)
        key = (type(unit), *((n, tuple(p.shape), p.dtype) for n, p in unit.named_parameters()))
        if key not in chosen:
            if children is None:
                chains = _chains(model, name, inputs, loss_fn)
                kids = _children(model, name, inputs, loss_fn, unit_saved[j])
                chosen[key] = [_with_chains(c, chains) for c in kids]
                if chains:
                    chosen[key].insert(0, Children(tuple((p, recv[-1]) for p, recv in chains)))
            else:
                kids = [c for c in children
                        if (o := _children_of(c)) and all(_has(unit, m) for r in o.regions for m in r)]
                chosen[key] = [Children.of(c) for c in kids]
            # the unit checkpointed whole with regions of its children nested inside: the forward
            # keeps what ``full`` keeps, the unit's backward less (ViT-Ti/16 blocks at 224 px: a
            # step of six peaked 44.6 MiB against full's 53.9)
            nested = _nested(unit, [o for o in chosen[key] if isinstance(o, Children)])
            if nested is not None:
                chosen[key].append(nested)
            # inside each chosen child, its cheap ops re-derived (and written-out attention's core):
            # what the gemm op set keeps there (measured cheaper than on the whole unit, whose child
            # options beat it), at the hooks' cost instead of SAC's dispatch mode over every op, and
            # keeping no more (gpt-small's MLP: 8,388,608 bytes shed against the op set's
            # 8,383,552); the op set on the whole unit only where no child stands out
            inner = [c for c in kids if _children_of(c) == Children(((c,),))]  # one module each
            derives = {"": _derive_options(model, name, inputs, loss_fn, unit_saved[j])}
            for c in inner:
                if _has_products(unit.get_submodule(c)):
                    derives[c] = [replace(o, child=c) for o in _derive_options(
                        model, f"{name}.{c}", inputs, loss_fn, unit_saved[j], CHILD_DERIVES, MIN_MORE)]
                    chosen[key] += derives[c]
            # the op sets (PyTorch's SAC: a dispatch mode over every op of the region, forward and
            # recompute) only where no derive level past cheap ops is offered on that module:
            # ``derive:products`` keeps the products and re-runs the rest, dropout's draws included
            # (gpt-small's attention: 27,252,864 bytes shed against ``selective:weights``'
            # 27,257,920, one generator state apart; the whole block: 44,057,792 against gemm's
            # 31,550,528), at the hooks' cost
            deep = {c for c, options in derives.items() if any(o.level >= DERIVE_PRODUCTS.level for o in options)}
            if not inner and _has_products(unit) and "" not in deep:
                chosen[key].append(Selective(GEMM))
            # written-out attention: its activation products' inputs and outputs recomputed, the
            # weight products kept (Megatron's core attention); where none runs this is gemm's twin
            between = _activation_products(model, name, inputs)
            chosen[key] += [Selective(WEIGHTS, c) for c in (inner or [""]) if c in between and c not in deep]
            chosen[key] += derives[""]
        out[name] = list(chosen[key])
    if names and DERIVE_ALL in out[names[-1]]:
        # the last unit's tail at the deepest level re-makes the unit's output for the final norm
        # through the unit's own products (an MLP's down-projection: HF ViT's 1.2 MiB for 3.4 ms a
        # step, which lowers the step's peak on nanoGPT and nothing on the ViT): the planner takes
        # it or leaves it
        out[names[-1]].append(replace(DERIVE_ALL, tail=False))
    return out


def _nested(unit: nn.Module, options: list[Children]) -> Nested | None:
    """One ``nested:`` option: the regions of the unit's child options, those whose members hold
    modules of their own first (attention, MLP: where the saved tensors are), then those of more
    regions, each region taken unless it overlaps one taken already; None where no region holds
    such a module (a ResNet block's convolutions, nested, peaked 10 KB above ``full``: leaf
    regions take nothing off the unit's recomputation, and each adds its RNG state). Of a GPT
    block's three child options nested alone, the one this takes peaked lowest in the backward
    (686 KB against 885 and 919, full's 952); a Llama block's two (``self_attn``, ``mlp``)
    become one."""

    def inner(region: tuple[str, ...]) -> int:
        return sum(1 for m in region if any(True for _ in unit.get_submodule(m).children()))

    taken: list[tuple[str, ...]] = []
    for option in sorted(options, key=lambda o: (sum(map(inner, o.regions)), len(o.regions)), reverse=True):
        for region in option.regions:
            if not any(_overlap(a, b) for r in taken for a in r for b in region):
                taken.append(region)
    if not any(map(inner, taken)):
        return None
    order = {name: k for k, (name, _) in enumerate(unit.named_modules())}
    return Nested(Children(tuple(sorted(taken, key=lambda r: order[r[0]]))))


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _activation_products(model: nn.Module, name: str, inputs: Inputs) -> set[str]:
    """The unit's children (and "" for the unit itself) inside which a product of two
    activations runs (``ACTIVATION_PRODUCTS``: q.k^T, probabilities.v), from one forward."""
    unit = model.get_submodule(name)
    stack: list[str] = []
    found: set[str] = set()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in ACTIVATION_PRODUCTS and stack:  # stack[0] is the unit (""), the rest its child's name
                found.update({"", stack[-1]})
            return func(*args, **(kwargs or {}))

    def push(rel: str) -> Any:
        def hook(_m: nn.Module, _args: Any) -> None:
            stack.append(rel)
        return hook

    def pop(_m: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    handles = [unit.register_forward_pre_hook(push("")), unit.register_forward_hook(pop)]
    for rel, m in unit.named_modules():
        if rel:
            handles += [m.register_forward_pre_hook(push(rel.split(".")[0])),  # the unit's own child, however deep
                        m.register_forward_hook(pop)]
    try:
        with torch.no_grad(), Watch():
            model(*inputs.args, **inputs.kwargs)
    finally:
        for h in handles:
            h.remove()
    return found


def _derive_options(model: nn.Module, name: str, inputs: Inputs, loss_fn: LossFn, saved: int,
                    levels: tuple[policy.Derive, ...] = DERIVES, bar: float = MIN_SHARE) -> list[policy.Derive]:
    """``derive`` where it sheds ``MIN_SHARE`` of the unit's saved bytes, ``derive:products``
    where going through products and softmax sheds more again (written-out attention's
    probabilities), ``derive:projections`` where going through attention's projections too sheds
    more still, and ``derive:all`` where every product with a weight does: ``MIN_SHARE`` beside no
    ``derive``, ``MIN_MORE`` beyond one. The bar beyond is low because one step measures the option
    on every unit that has it, so a unit that has it costs the profile nothing, and the planner
    weighs what it frees against what it costs: two heads' probabilities at 128 tokens are 8% of a
    block's saved bytes, and the compiler's partitioner recomputes them first
    (benchmarks/uneven-gpt.toml at budget 0.6). ``name`` may be a child of the unit whose saved
    bytes are ``saved``: ``levels`` are then those tried there and ``bar`` the share the first must shed."""
    if saved <= 0:
        return []
    out: list[policy.Derive] = []
    shed = 0
    for option in levels:
        more = _derivable(model, name, inputs, loss_fn, option)
        if more - shed >= (MIN_MORE if out else bar) * saved:
            out.append(option)
            shed = more
    return out


def _derivable(model: nn.Module, name: str, inputs: Inputs, loss_fn: LossFn, option: policy.Derive) -> int:
    """Bytes the unit's saved tensors would shed under ``option`` (one forward, not kept)."""
    derive = Derive(model.get_submodule(name), option.level)
    try:
        loss_fn(model(*inputs.args, **inputs.kwargs))
    finally:
        derive.remove()
    return derive.derived_bytes


def _has_products(module: nn.Module) -> bool:
    """Weight matrices or kernels: products worth keeping while the rest is recomputed."""
    return any(p.dim() >= 2 for p in module.parameters())


def _has(unit: nn.Module, path: str) -> bool:
    try:
        unit.get_submodule(path)
    except AttributeError:
        return False
    return bool(path)


def _children(model: nn.Module, name: str, inputs: Inputs, loss_fn: LossFn, saved: int) -> list[str]:
    unit = model.get_submodule(name)
    children = [c for c, m in unit.named_children() if any(True for _ in m.parameters())]
    if len(children) < 2 or saved <= 0:  # one child with all the parameters is the unit itself
        return []
    try:
        facts = unit_facts(model, [f"{name}.{c}" for c in children], inputs, loss_fn)
    except MemfitError:  # a child that runs twice in one forward cannot be a region of its own
        return []
    ranked = sorted(((s, c) for c, s in zip(children, facts.saved, strict=True) if s >= MIN_SHARE * saved),
                    key=lambda t: -t[0])
    return [c for _, c in ranked[:MAX_CHILDREN]]


def _with_chains(x: str, chains: list[tuple[str, list[str]]]) -> Children:
    """Child X with X's own producer in front (``ln_2>mlp``) and the chains outside X."""
    regions = [(x,)]
    for p, recv in chains:
        if x in recv:
            regions[0] = (p, x)
        elif not any(_within(m, x) or _within(x, m) for m in (p, recv[-1])):
            regions.append((p, recv[-1]))
    return Children(tuple(regions))


def _children_of(names: str) -> Children | None:
    try:
        return Children.of(names)
    except PolicyError:
        return None


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


def _chains(model: nn.Module, name: str, inputs: Inputs, loss_fn: LossFn) -> list[tuple[str, list[str]]]:
    """(producer, the modules it feeds, outermost first) for each chain in the unit: a module
    without weight matrices, called once, whose output goes straight (no tensor saved in
    between) into modules of which the innermost has products, and which nothing but that
    innermost module saves."""
    unit = model.get_submodule(name)
    mods = {rel: m for rel, m in unit.named_modules() if rel}
    events: list[tuple[str, str, Any]] = []  # ("in"|"out", module, tensor) or ("save", stack, storage key)
    stack: list[str] = []
    active = [False]

    def pre(rel: str) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if active[0]:
                stack.append(rel)
                events.append(("in", rel, args[0] if args and isinstance(args[0], torch.Tensor) else None))
        return hook

    def post(rel: str) -> Any:
        def hook(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            if active[0]:
                stack.pop()
                events.append(("out", rel, out if isinstance(out, torch.Tensor) else None))
        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        if active[0]:
            events.append(("save", "/".join(stack), storage_key(t.untyped_storage())))
        return packed(t)

    def unit_on(on: bool) -> Any:
        def hook(*_: Any) -> None:
            active[0] = on
        return hook

    handles = [unit.register_forward_pre_hook(unit_on(True)), unit.register_forward_hook(unit_on(False))]
    for rel, m in mods.items():
        handles += [m.register_forward_pre_hook(pre(rel)), m.register_forward_hook(post(rel))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(*inputs.args, **inputs.kwargs))  # kept: its graph keeps storage keys unique
    finally:
        for h in handles:
            h.remove()
    found = _chains_in(events, mods)
    events.clear()
    del loss
    return found


def _chains_in(events: list[tuple[str, str, Any]], mods: dict[str, nn.Module]) -> list[tuple[str, list[str]]]:
    """The chains in one watched forward's events (see ``_chains``)."""
    calls = [e[1] for e in events if e[0] == "in"]
    found = []
    for i, (kind, p, out) in enumerate(events):
        if kind != "out" or out is None or calls.count(p) != 1 or _has_products(mods[p]):
            continue
        recv: list[str] = []
        for k2, m, t in events[i + 1:]:
            if k2 == "save":
                break
            if k2 == "in" and t is out:
                recv.append(m)
        if not recv or not _has_products(mods[recv[-1]]) or calls.count(recv[-1]) != 1:
            continue
        st = storage_key(out.untyped_storage())
        savers = [e[1] for e in events if e[0] == "save" and e[2] == st]
        if savers and all(recv[-1] in s.split("/") for s in savers):
            found.append((p, recv))
    return found
