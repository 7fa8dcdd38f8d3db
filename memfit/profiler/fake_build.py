"""Building a user's model on fake tensors (estimate mode) as it builds for real.

Two things in ordinary model code need values that fake tensors do not hold:

- weight initialisers: ``torch.nn.init.trunc_normal_`` redraws until every value is in range (a
  data-dependent loop fake tensors refuse), and Hugging Face's ViT, Swin and ConvNeXt, timm and
  many users call it. While building, ``torch.nn.init``'s in-place initialisers are no-ops (the
  values do not matter here), and so are the references Hugging Face keeps to them
  (``transformers.initialization.TORCH_INIT_FUNCTIONS``), put back afterwards, also in a copy of
  them that a library imported during the build took.
- small computations read in Python: drop-path rates (``torch.linspace(0, p, n).tolist()`` in
  Hugging Face's ConvNeXt and Swin), relative-position tables. Ops on tensors that hold values,
  and ``arange``/``linspace``/``logspace`` of a few elements, run for real while building; what they
  leave in the model (a buffer of indices) becomes a fake tensor before the step runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from memfit.torch_private import (
    FakeTensorMode,
    TorchDispatchMode,
    is_fake,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)

SMALL = 1 << 16  # elements: what may run for real while building
_aten = torch.ops.aten
_RANGES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.linspace.default,
           _aten.logspace.default}


def _untouched(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


class _SmallValues(TorchDispatchMode):
    """Above the fake mode while a model is built: an op whose tensors all hold values (none is
    fake), or a range of a few elements, runs for real; every other op goes on to the fake mode."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        real = bool(tensors) and not any(is_fake(t) for t in tensors)
        if not real and not (func in _RANGES and _range_length(func, args, kwargs) <= SMALL):
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            out = func(*args, **kwargs)
        return tree_map(lambda t: self.fake.from_tensor(t) if isinstance(t, torch.Tensor) and t.numel() > SMALL
                        else t, out)


def _range_length(func: Any, args: Any, kwargs: dict[str, Any]) -> float:
    if func in (_aten.linspace.default, _aten.logspace.default):
        return float(args[2] if len(args) > 2 else kwargs.get("steps", 0))
    start, end, step = (0, args[0], 1) if func is _aten.arange.default else (args[0], args[1], 1)
    if func is _aten.arange.start_step:
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    try:
        return abs((float(end) - float(start)) / float(step))
    except (TypeError, ValueError, ZeroDivisionError):
        return float("inf")


@contextmanager
def fake_build(fake: FakeTensorMode) -> Iterator[None]:
    """Around ``build()`` under ``fake``: initialisers as no-ops, small computations for real."""
    tables: list[dict[str, Any]] = [torch.nn.init.__dict__]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    saved = [(table, dict(table)) for table in tables]
    for table in tables:
        for name, fn in list(table.items()):
            if callable(fn) and name.endswith("_") and not name.startswith("_"):
                table[name] = _untouched
    try:
        with _SmallValues(fake):
            yield
    finally:
        for table, original in saved:
            table.update(original)
        hf = sys.modules.get("transformers.initialization")  # imported meanwhile: it took the no-ops
        table = getattr(hf, "TORCH_INIT_FUNCTIONS", None) if hf is not None else None
        if isinstance(table, dict):
            torch_init = saved[0][1]
            table.update({k: torch_init[k] for k, fn in table.items() if fn is _untouched and k in torch_init})


def real_to_fake(fake: FakeTensorMode, built: Any) -> Any:
    """``built`` (``(model, inputs)``, or modules and inputs nested in tuples and lists: a
    pipeline's stages) with every tensor the build left real (a module's buffer of indices, an
    input made from a list) turned fake, as the step runs under the fake mode alone."""
    if isinstance(built, nn.Module):
        for module in built.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and not is_fake(buf):
                    module._buffers[name] = fake.from_tensor(buf)
            for name, p in list(module._parameters.items()):
                if p is not None and not is_fake(p):
                    module._parameters[name] = nn.Parameter(fake.from_tensor(p.detach()), requires_grad=p.requires_grad)
        return built
    if isinstance(built, (tuple, list)) and any(isinstance(b, (nn.Module, tuple, list)) for b in built):
        return type(built)(real_to_fake(fake, b) for b in built)
    return tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) and not is_fake(t) else t, built)
