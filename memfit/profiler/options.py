"""Which finer options to measure for each unit: its children worth checkpointing alone, and
op-level policies on the whole unit and on each of those children.

A child is a candidate when it has parameters (it computes something dear enough to be worth
keeping the rest of the unit) and makes at least ``MIN_SHARE`` of the bytes the unit saves for
backward (checkpointing it can free something). Units of one class and parameter shapes share
the choice, made once on the first of them.
"""

from __future__ import annotations

from torch import nn

from memfit.errors import MemfitError
from memfit.measure.step import Inputs, LossFn
from memfit.profiler.saved import unit_facts

MIN_SHARE = 0.1  # of the unit's saved bytes
MAX_CHILDREN = 3  # child options per unit class, the largest savers first


def fine_options(model: nn.Module, names: list[str], inputs: Inputs, loss_fn: LossFn,
                 unit_saved: list[int], children: list[str] | None = None) -> dict[str, list[str]]:
    """Unit name -> its finer options (``child:<name>``, ``selective:gemm``), in a fixed order.
    ``children`` (relative module names, ``a+b`` for several at once) replaces the automatic
    choice of children; a unit without one of them is not offered it."""
    out: dict[str, list[str]] = {}
    chosen: dict[tuple[object, ...], list[str]] = {}
    for j, name in enumerate(names):
        unit = model.get_submodule(name)
        key = (type(unit), *((n, tuple(p.shape), p.dtype) for n, p in unit.named_parameters()))
        if key not in chosen:
            if children is None:
                chosen[key] = _children(model, name, inputs, loss_fn, unit_saved[j])
            else:
                chosen[key] = [f"child:{c}" for c in children if all(_has(unit, m) for m in c.split("+"))]
            # the op policy inside each chosen child (measured cheaper than on the whole unit, whose
            # child options beat it: GPT block 30 MiB kept for 25 ms, attention alone 26 MiB for 23 ms);
            # on the whole unit only where no child stands out
            inner = [c for c in (o[len("child:"):] for o in chosen[key]) if "+" not in c]
            chosen[key] += [f"selective:gemm@{c}" for c in inner if _has_products(unit.get_submodule(c))]
            if not inner and _has_products(unit):
                chosen[key].append("selective:gemm")
        out[name] = list(chosen[key])
    return out


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
    return [f"child:{c}" for _, c in ranked[:MAX_CHILDREN]]
