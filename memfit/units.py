"""Cutting a model into units: the repeated blocks a schedule checkpoints or keeps."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from memfit.errors import MemfitError, UnitSelectionError


def require_module(model: object, call: str) -> None:
    """A ``MemfitError`` saying what to pass where a model object was expected and something
    else came (a class, a scenario's name)."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise MemfitError(f"{call} takes a model, not its class: build it first, {call}({model.__name__}(...), ...)")
    if isinstance(model, str):
        raise MemfitError(f"{call} takes the model itself (a torch.nn.Module), not a name; for a built-in model or "
                          f"a scenario use the command line: memfit plan --scenario {model} --budget 24GB")
    raise MemfitError(f"{call} takes a torch.nn.Module, not a {type(model).__name__}")


def find_units(model: nn.Module, spec: str | Sequence[str] = "auto") -> list[str]:
    """Names of the units, in forward order.

    ``"auto"`` picks the repeated blocks (``_auto_units``); otherwise ``spec`` lists module
    names or glob patterns (``"model.layers.*"``), matched against ``model.named_modules()``.
    """
    require_module(model, "memfit")
    if isinstance(spec, str) and spec == "auto":
        return _auto_units(model)
    patterns = [spec] if isinstance(spec, str) else list(spec)
    names = [n for n, _ in model.named_modules() if n]
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if matches(n, pattern)]
        if not hits:
            raise UnitSelectionError(
                f"no module matches the unit pattern {pattern!r}; "
                f"top-level modules are: {', '.join(n for n in names if '.' not in n)}"
            )
        chosen.extend(h for h in hits if h not in chosen)
    for a in chosen:
        for b in chosen:
            if a != b and b.startswith(a + "."):
                raise UnitSelectionError(f"unit {b!r} lies inside unit {a!r}: units must not nest")
    return chosen


def matches(name: str, pattern: str) -> bool:
    """Glob by dotted component: ``layers.*`` matches ``layers.3`` but not ``layers.3.mlp``."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats, strict=True))


_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _auto_units(model: nn.Module) -> list[str]:
    """The repeated blocks: a class of which some ``nn.ModuleList``/``nn.Sequential`` holds two or
    more modules with parameters and nothing else, and all its modules in the model, so that the
    residual blocks of all of a ResNet's stages are units (``layer1.0`` … ``layer4.2``, not only
    the longest stage). Not blocks: containers themselves, and stages, whose children are
    containers of blocks and at most one more module (a downsample); their blocks are. Of the
    classes left, every outermost one (none of its blocks inside another's: an encoder's layers
    and a decoder's both), in the model's order; where every class nests in another, the one with
    the most blocks, then parameters. A heuristic: name the units (``units=``/``--units``) where
    it picks wrong."""
    named = list(model.named_modules())
    classes: set[type[nn.Module]] = set()
    for _, module in named:
        if not isinstance(module, _CONTAINERS) or len(module) < 2:
            continue
        kinds = {type(child) for child in module.children()}
        if len(kinds) == 1 and any(True for _ in next(iter(module)).parameters()):
            classes |= kinds
    if not classes:
        raise UnitSelectionError(
            "found no nn.ModuleList or nn.Sequential of two or more blocks of one class to use as "
            "units; name them with --units (units=[...] in Python): module names or globs such as 'layers.*'"
        )
    groups = {k: [(n, m) for n, m in named if n and type(m) is k] for k in classes}
    holders = {id(m) for _, m in named if isinstance(m, _CONTAINERS) and len(m) >= 1
               and all(type(c) in classes for c in m.children())}

    def stage(member: nn.Module) -> bool:
        children = list(member.children())
        held = sum(id(c) in holders for c in children)
        return held >= 1 and len(children) - held <= 1

    blocks = {k: v for k, v in groups.items()
              if not issubclass(k, _CONTAINERS) and not all(stage(m) for _, m in v)} or groups
    names = {k: [n for n, _ in v] for k, v in blocks.items()}
    every = [n for v in names.values() for n in v]
    outer = {k: v for k, v in names.items() if not any(n.startswith(o + ".") for n in v for o in every)}
    if outer:  # every outermost class: an encoder's layers and a decoder's, a U-Net's down and up blocks
        order = {n: i for i, (n, _) in enumerate(named)}
        return sorted((n for v in outer.values() for n in v), key=order.__getitem__)
    best = max(names, key=lambda k: (len(names[k]), sum(p.numel() for _, m in blocks[k] for p in m.parameters())))
    chosen = names[best]
    return [n for n in chosen if not any(n.startswith(o + ".") for o in chosen)]  # outermost, if a class nests


def summary(names: Sequence[str]) -> str:
    """The units by the container holding them, in forward order: ``model.encoder.layers.0-11 (12),
    model.decoder.layers.0-11 (12)``; what the automatic choice took, said so that one left out shows."""
    groups: dict[str, list[str]] = {}
    for n in names:
        head, _, last = n.rpartition(".")
        groups.setdefault(head, []).append(last)
    out = []
    for head, lasts in groups.items():
        prefix = head + "." if head else ""
        span = f"{lasts[0]}-{lasts[-1]}" if len(lasts) > 1 and all(x.isdigit() for x in lasts) else None
        out.append(f"{prefix}{span} ({len(lasts)})" if span else ", ".join(prefix + x for x in lasts))
    return ", ".join(out)
