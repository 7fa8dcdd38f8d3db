"""Cutting a model into units: the repeated blocks a schedule checkpoints or keeps."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from memfit.errors import UnitSelectionError


def find_units(model: nn.Module, spec: str | Sequence[str] = "auto") -> list[str]:
    """Names of the units, in forward order.

    ``"auto"`` picks the longest ``nn.ModuleList``/``nn.Sequential`` whose children all share
    one class (the transformer layers, the residual blocks); otherwise ``spec`` lists module
    names or glob patterns (``"model.layers.*"``), matched against ``model.named_modules()``.
    """
    if isinstance(spec, str) and spec == "auto":
        return _auto_units(model)
    patterns = [spec] if isinstance(spec, str) else list(spec)
    names = [n for n, _ in model.named_modules() if n]
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if _matches(n, pattern)]
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


def _matches(name: str, pattern: str) -> bool:
    """Glob by dotted component: ``layers.*`` matches ``layers.3`` but not ``layers.3.mlp``."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats, strict=True))


def _auto_units(model: nn.Module) -> list[str]:
    best: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        classes = {type(child) for child in module}
        if len(classes) != 1 or not any(True for _ in next(iter(module)).parameters()):
            continue
        if len(module) > len(best):
            prefix = f"{name}." if name else ""
            best = [f"{prefix}{child}" for child, _ in module.named_children()]
    if not best:
        raise UnitSelectionError(
            "found no nn.ModuleList or nn.Sequential of two or more blocks of one class to use as "
            "units; name them with --units (units=[...] in Python): module names or globs such as 'layers.*'"
        )
    return best
