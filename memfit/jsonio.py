"""Versioned JSON files: atomic writes and loads that name the field at fault."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from memfit.errors import FileFormatError


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so no reader or crash
    ever sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | os.PathLike[str], expected_format: str) -> dict[str, Any]:
    """Read a memfit JSON file and check its ``format`` tag."""
    p = Path(path)
    if not p.is_file():
        raise FileFormatError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FileFormatError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{p}: expected a JSON object at the top level")
    fmt = data.get("format")
    if fmt != expected_format:
        raise FileFormatError(f"{p}: field 'format' is {fmt!r}, expected {expected_format!r}")
    return data


class Fields:
    """Typed access to a JSON object; every error names the file and the field."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise FileFormatError(f"{where}: expected an object")
        self.data = data
        self.where = where

    def _get(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        if key not in self.data:
            raise FileFormatError(f"{self.where}: missing field {key!r}")
        value = self.data[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise FileFormatError(f"{self.where}: field {key!r} must be {what}, got {value!r}")
        return value

    def int(self, key: str) -> int:
        return int(self._get(key, (int,), "an integer"))

    def float(self, key: str) -> float:
        return float(self._get(key, (int, float), "a number"))

    def str(self, key: str) -> str:
        return str(self._get(key, (str,), "a string"))

    def opt_str(self, key: str) -> str | None:
        if self.data.get(key) is None:
            return None
        return self.str(key)

    def list(self, key: str) -> list[Any]:
        return list(self._get(key, (list,), "a list"))

    def obj(self, key: str) -> Fields:
        return Fields(self._get(key, (dict,), "an object"), f"{self.where}.{key}")

    def items(self, key: str) -> list[Fields]:
        return [Fields(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(self.list(key))]
