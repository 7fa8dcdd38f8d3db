"""A user's model factory, imported from ``package.module:function`` or ``path/to/file.py:function``
(what ``--model`` and a scenario's ``model`` name)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError


def load_factory(spec: str, base: Path | None = None) -> Any:
    """Import ``package.module:attribute``, or ``path/to/file.py:attribute``. A module is looked
    for beside ``base`` (a scenario file's folder) first, then in the working directory; a file
    path is taken relative to the same."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise MemfitError(f"a model factory is written module:function, e.g. mypkg.models:build or "
                          f"mymodels.py:build; got {spec!r}")
    places = [str(p) for p in (base, Path.cwd()) if p is not None]
    for place in reversed(places):  # so that a user's own train.py-side module imports
        if place not in sys.path:
            sys.path.insert(0, place)
    if module_name.endswith(".py"):
        module = _import_file(module_name, base)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            where = f" (looked beside {base} and in {Path.cwd()})" if base else ""
            raise MemfitError(f"cannot import {module_name!r} for the model factory {spec!r}{where}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise MemfitError(f"module {module_name!r} has no attribute {attr!r}") from None


def _import_file(name: str, base: Path | None) -> Any:
    """A model file named by its path, imported under its stem (its folder on sys.path, so that
    it imports its neighbours)."""
    import importlib.util

    path = Path(name)
    if not path.is_absolute():
        path = next((b / path for b in (base, Path.cwd()) if b is not None and (b / path).is_file()), Path.cwd() / path)
    if not path.is_file():
        raise MemfitError(f"{name}: no such model file")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
