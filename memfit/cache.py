"""The cache ``memfit.fit`` keeps between runs of a training script, so that a second run of the
same script loads its plan instead of profiling again.

An entry is a folder named by a hash of its key: the model's fingerprint (architecture, not
weights), the input signature, the training step, the device and the versions of memfit and
torch. It holds ``key.json`` (the key itself, compared in full on every read: a hash is no
proof), ``profile.json`` and one ``plan-<hash>.json`` per budget and planning options. Whatever
does not read back whole and matching is ignored with a ``CacheWarning`` and written again,
never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from memfit.errors import CacheWarning, MemfitError
from memfit.jsonio import read_json, write_json_atomic

KEY_FORMAT = "memfit.cache-key/1"


def cache_root(cache_dir: str | os.PathLike[str] | bool | None) -> Path | None:
    """Where entries live: ``cache_dir``; for None, ``$MEMFIT_CACHE``, else ``memfit`` under the
    user's cache directory (``$XDG_CACHE_HOME``, default ``~/.cache``); False: no cache."""
    if cache_dir is False:
        return None
    if cache_dir is True or cache_dir is None:
        env = os.environ.get("MEMFIT_CACHE")
        if env:
            return Path(env).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).expanduser() / "memfit"
    if isinstance(cache_dir, (str, os.PathLike)):
        return Path(cache_dir).expanduser()
    raise MemfitError(f"cache_dir must be a folder, None (the default cache) or False (no cache), got {cache_dir!r}")


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:24]


class Entry:
    """One cache entry: the folder of a key."""

    def __init__(self, root: Path, key: dict[str, Any]) -> None:
        self.key = key
        self.folder = root / digest(key)
        self._trust: bool | None = None  # known after the first read: whether key.json is this key

    def _trusted(self) -> bool:
        """True when the folder's key.json is this key; warns (once) when it exists and is not."""
        if self._trust is None:
            self._trust = self._check()
        return self._trust

    def _check(self) -> bool:
        path = self.folder / "key.json"
        if not path.exists():
            return False
        try:
            stored = read_json(path, KEY_FORMAT).get("key")
        except MemfitError as exc:
            return _ignored(self.folder, str(exc), stacklevel=6)
        if stored != json.loads(json.dumps(self.key, default=str)):
            return _ignored(self.folder, "its key is not this model's, inputs', step's, device's and version's",
                            stacklevel=6)
        return True

    def read(self, name: str, load: Any) -> Any:
        """``load(path)`` of the file ``name`` in a trusted entry, or None (missing, or ignored
        with a warning when it does not load)."""
        path = self.folder / name
        if not path.exists() or not self._trusted():
            return None
        try:
            return load(path)
        except (MemfitError, KeyError, TypeError, ValueError) as exc:
            _ignored(path, str(exc))
            return None

    def write(self, name: str, save: Any) -> Path | None:
        """``save(path)`` into the entry (its key first); a cache that cannot be written is
        skipped with a warning: the run goes on without it."""
        try:
            if not self._trusted():  # a folder of another key (or none): nothing in it is this key's
                for old in self.folder.glob("*.json"):
                    old.unlink()
                write_json_atomic(self.folder / "key.json", {"format": KEY_FORMAT, "key": self.key})
                self._trust = True
            save(self.folder / name)
        except (MemfitError, OSError) as exc:
            warnings.warn(CacheWarning(f"memfit: could not write the cache ({exc}); going on without it"),
                          stacklevel=3)
            return None
        return self.folder / name


def _ignored(where: Path, why: str, stacklevel: int = 4) -> bool:
    """Warn, pointing at the caller of ``memfit.fit`` (``stacklevel`` frames up), and say no."""
    warnings.warn(CacheWarning(f"memfit: ignored the cache entry {where}: {why}; profiling again and "
                               "overwriting it"), stacklevel=stacklevel)
    return False
