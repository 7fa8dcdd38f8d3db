"""A training step's inputs (the forward's positional and keyword arguments) and the walk over
the tensors nested in them, or in a model's outputs."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError


def forward_names(model: nn.Module) -> list[str] | None:
    """The parameters ``model.forward`` names (not ``*args``, ``**kwargs``); None where Python
    cannot read its signature."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@dataclass(slots=True)
class Inputs:
    """Positional and keyword arguments of the model's forward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    given: Any = None  # the object the caller passed, for a step function of their own

    @staticmethod
    def of(inputs: Any) -> Inputs:
        if isinstance(inputs, Inputs):
            return inputs
        if isinstance(inputs, torch.Tensor):
            return Inputs((inputs,), {}, inputs)
        if isinstance(inputs, tuple):
            return Inputs(inputs, {}, inputs)
        if isinstance(inputs, dict):
            return Inputs((), dict(inputs), inputs)
        raise MemfitError(
            f"inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
            f"arguments, got {type(inputs).__name__}"
        )

    def tensors(self) -> list[torch.Tensor]:
        return list(iter_tensors((self.args, self.kwargs)))

    def unknown_to(self, model: nn.Module) -> list[str]:
        """The keyword inputs that ``model.forward`` does not name (a misspelt ``pixels`` for
        ``pixel_values``), though a ``**kwargs`` of its own may take them."""
        names = forward_names(model)
        return [] if names is None else [k for k in self.kwargs if k not in names]

    def describe(self) -> str:
        """Shapes and dtypes, one entry per tensor: ``float32[4,16]`` for a positional argument,
        ``mask=float32[4,16,1]`` for a keyword one, and a path for one nested in lists, tuples,
        dicts or dataclasses (``batch.0=int64[8,512]``, ``1.image=float32[8,3,224,224]``); other
        values by their type (``use_cache=bool``)."""
        parts = [p for i, a in enumerate(self.args) for p in described(a, "" if _leaf(a) else str(i))]
        parts += [p for k, v in self.kwargs.items() for p in described(v, k)]
        return ", ".join(parts)


def _leaf(value: Any) -> bool:
    return not (isinstance(value, (tuple, list, dict)) or dataclasses.is_dataclass(value)) or not _children(value)


def _children(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    return []


def described(value: Any, path: str) -> list[str]:
    """``value`` (a tensor, or nested values holding some) in the words of ``Inputs.describe``,
    under ``path``."""
    name = f"{path}=" if path else ""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return [f"{name}{dtype}[{','.join(str(s) for s in value.shape)}]"]
    if _leaf(value):
        return [f"{name}{type(value).__name__}"]
    return [p for k, v in _children(value) for p in described(v, f"{path}.{k}" if path else k)]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists, dicts, dataclasses and Hugging Face ModelOutputs, in
    order (the paths ``Inputs.describe`` names)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
