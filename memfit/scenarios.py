"""Scenarios: a model factory, its inputs and settings, from a TOML file or a ``module:factory``."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BUILTIN_DIR = Path(__file__).parent / "builtin_scenarios"
DEFAULT = "gpt-small"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class Scenario:
    name: str
    model: str  # "package.module:factory"; the factory returns (model, inputs) or a model
    description: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] | None = None  # random normal input, when the factory returns only a model
    optimizer: str = "adamw"
    units: str | list[str] = "auto"
    dtype: str = "float32"

    def build(self) -> tuple[nn.Module, Any]:
        """Call the factory; move to the dtype; make inputs if the factory gave none."""
        factory = load_factory(self.model)
        try:
            made = factory(**self.args)
        except TypeError as exc:
            raise MemfitError(f"scenario {self.name!r}: calling {self.model} failed: {exc}") from None
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
            model, inputs = made
        elif isinstance(made, nn.Module):
            if not self.input_shape:
                raise MemfitError(
                    f"{self.model} returned only a model: give the input shape (--input-shape 8x3x224x224 "
                    "or input_shape = [...] in the scenario), or return (model, inputs)"
                )
            model, inputs = made, (torch.randn(*self.input_shape),)
        else:
            raise MemfitError(f"{self.model} must return an nn.Module or (module, inputs)")
        if self.dtype not in DTYPES:
            raise MemfitError(f"scenario {self.name!r}: unknown dtype {self.dtype!r}; use one of {list(DTYPES)}")
        dtype = DTYPES[self.dtype]
        if dtype != torch.float32:
            model = model.to(dtype)
            inputs = _cast(inputs, dtype)
        return model, inputs


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_cast(v, dtype) for v in obj)
    return obj


def load_factory(spec: str) -> Any:
    """Import ``package.module:attribute``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise MemfitError(f"a model factory is written module:function, e.g. mypkg.models:build; got {spec!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # so that a user's own train.py-side module imports
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise MemfitError(f"cannot import {module_name!r} for the model factory {spec!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise MemfitError(f"module {module_name!r} has no attribute {attr!r}") from None


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix == ".toml":
        path = BUILTIN_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise MemfitError(
                f"no scenario named {name_or_path!r}; built-in scenarios: {', '.join(builtin_names())} "
                "(or give a path to a .toml file)"
            )
    if not path.is_file():
        raise MemfitError(f"{path}: no such scenario file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise MemfitError(f"{path}: not valid TOML ({exc})") from None
    known = {"description", "model", "args", "input_shape", "optimizer", "units", "dtype", "requires"}
    unknown = set(data) - known
    if unknown:
        raise MemfitError(f"{path}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    if "model" not in data:
        raise MemfitError(f"{path}: missing field 'model' (module:factory)")
    return Scenario(
        name=path.stem,
        model=str(data["model"]),
        description=str(data.get("description", "")),
        args=dict(data.get("args", {})),
        input_shape=data.get("input_shape"),
        optimizer=str(data.get("optimizer", "adamw")),
        units=data.get("units", "auto"),
        dtype=str(data.get("dtype", "float32")),
    )
