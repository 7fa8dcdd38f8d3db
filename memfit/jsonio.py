"""Versioned JSON files: atomic writes and loads that name the field at fault."""

from __future__ import annotations

import json
import math
import os
import tempfile
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.errors import FileFormatError, MemfitError


def check_writable(path: str | os.PathLike[str], what: str = "output file") -> Path:
    """Fail now, not after minutes of profiling, if ``path`` cannot be written: empty, a
    directory, in a directory that does not exist, under a file, or in a place this process may
    not create files in."""
    target = _target(path, what)
    parent = target.parent
    if not parent.exists():  # a typo in a path would otherwise become a tree of new directories
        raise MemfitError(f"{target}: cannot write the {what}: the directory {parent} does not exist (create it "
                          f"first: mkdir -p {parent})")
    if not parent.is_dir():
        raise MemfitError(f"{target}: cannot write the {what}: {parent} is a file, not a directory")
    try:  # os.access says yes to root on a read-only file system: try it
        fd, probe = tempfile.mkstemp(prefix=".memfit-probe.", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise MemfitError(f"{target}: cannot write the {what} there ({exc.strerror or exc})") from None
    return target


def _target(path: str | os.PathLike[str], what: str) -> Path:
    """The file to write: a symbolic link's target; never a directory, a device or a pipe."""
    if not str(path).strip():
        raise MemfitError(f"the {what} name is empty; give a file name such as schedule.json")
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()  # write the file the link names, and keep the link
    if target.exists() and not target.is_dir() and not target.is_file():
        raise MemfitError(f"{target}: is not a regular file (a device or a pipe); give a file name for the {what}")
    if target.is_dir():
        raise MemfitError(f"{target}: is a directory; give a file name for the {what}, e.g. {target / 'out.json'}")
    return target


def check_replaceable(path: str | os.PathLike[str], what: str) -> None:
    """A memfit JSON output may replace an earlier memfit file, never another file (a model's
    source, a scenario, someone's data)."""
    check_writable(path, what)
    target = Path(path).resolve()
    if target.is_file():
        try:
            read_json(target, None)
        except FileFormatError:
            raise MemfitError(f"{path} exists and is not a memfit file; refusing to overwrite it with the "
                              f"{what} (remove it first, or write elsewhere)") from None


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see ``write_atomic``)."""

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())

    write_atomic(path, dump)


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Have ``write`` fill a temporary file beside ``path``, then rename it over ``path``, so
    that no reader or crash ever sees half a file. The file gets the mode the umask gives a new
    file (mkstemp's 0600 would hide a schedule from the rest of a team)."""
    target = _target(path, "output file")  # creating the temporary file below is the write test
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise MemfitError(f"{target}: cannot write ({exc.strerror or exc})") from None
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise MemfitError(f"{target}: cannot write ({exc.strerror or exc})") from None
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def read_json(path: str | os.PathLike[str], expected_format: str | None) -> dict[str, Any]:
    """Read a memfit JSON file and check its ``format`` tag (any memfit format for None)."""
    p = Path(path)
    if p.is_dir():
        raise FileFormatError(f"{p}: is a directory, not a memfit JSON file")
    if not p.is_file():
        raise FileFormatError(f"{p}: no such file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FileFormatError(f"{p}: not valid JSON ({exc})") from None
    except (RecursionError, ValueError) as exc:  # nested too deep; an integer of thousands of digits
        raise FileFormatError(f"{p}: not a memfit file ({type(exc).__name__}: {str(exc)[:80]})") from None
    except OSError as exc:
        raise FileFormatError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise FileFormatError(f"{p}: expected a JSON object at the top level")
    fmt = data.get("format")
    if expected_format is None:
        if not (isinstance(fmt, str) and fmt.startswith("memfit.")):
            raise FileFormatError(f"{p}: not a memfit file (field 'format' is {fmt!r})")
    elif fmt != expected_format:
        raise FileFormatError(f"{p}: field 'format' is {fmt!r}, expected {expected_format!r}")
    return data


class Fields:
    """Typed access to a JSON object; every error names the file and the field."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise FileFormatError(f"{where}: expected an object")
        self.data = data
        self.where = where
        self.prefix = prefix  # said before each field's name: "source." names source.units

    def _name(self, key: str) -> str:
        return repr(self.prefix + key)

    def _get(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        if key not in self.data:
            raise FileFormatError(f"{self.where}: missing field {self._name(key)}")
        value = self.data[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise FileFormatError(f"{self.where}: field {self._name(key)} must be {what}, got {value!r}")
        return value

    def int(self, key: str, minimum: int | None = None) -> int:
        value = int(self._get(key, (int,), "an integer"))
        if abs(value) >= 2**62:
            raise FileFormatError(f"{self.where}: field {self._name(key)} is out of range ({str(value)[:20]}...)")
        if minimum is not None and value < minimum:
            raise FileFormatError(f"{self.where}: field {self._name(key)} must be at least {minimum}, got {value}")
        return value

    def float(self, key: str, minimum: float | None = None) -> float:
        value = float(self._get(key, (int, float), "a number"))
        if not math.isfinite(value) or (minimum is not None and value < minimum):
            raise FileFormatError(f"{self.where}: field {self._name(key)} must be a finite number"
                                  + (f" of at least {minimum}" if minimum is not None else "") + f", got {value}")
        return value

    def str(self, key: str) -> str:
        return str(self._get(key, (str,), "a string"))

    def bool(self, key: str) -> bool:
        return bool(self._get(key, (bool,), "true or false"))

    def opt_str(self, key: str) -> str | None:
        if self.data.get(key) is None:
            return None
        return self.str(key)

    def list(self, key: str) -> list[Any]:
        return list(self._get(key, (list,), "a list"))

    def obj(self, key: str) -> Fields:
        return Fields(self._get(key, (dict,), "an object"), f"{self.where}.{key}")

    def record(self, kind: Any, minimum: dict[str, float] | None = None) -> dict[str, Any]:
        """This object as the TypedDict ``kind``: each field checked against its annotated type
        (``minimum`` for numbers), optional ones only where present; fields it lacks are dropped.
        Every record in memfit's files is read by this one method."""
        hints = typing.get_type_hints(kind)
        keys = [*(k for k in self.data if k in hints), *(k for k in kind.__required_keys__ if k not in self.data)]
        return {k: self._typed(k, hints[k], (minimum or {}).get(k)) for k in keys}  # in the file's order

    def _typed(self, key: str, hint: Any, minimum: float | None) -> Any:
        if hint is int:
            return self.int(key, None if minimum is None else int(minimum))
        if hint is float:
            return self.float(key, minimum)
        if hint is str:
            return self.str(key)
        if hint is bool:
            return self.bool(key)
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kinds = tuple(typing.get_origin(o) or o for o in options)  # list[int] -> list
        return self._get(key, kinds, " or ".join(_WORDS.get(k, k.__name__) for k in kinds))

    def items(self, key: str) -> list[Fields]:
        return [Fields(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(self.list(key))]


_WORDS = {type(None): "null", list: "a list", dict: "an object", str: "a string", int: "an integer",
          float: "a number", bool: "true or false"}
