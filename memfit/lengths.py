"""Planning for several input shapes from the command line: sequence lengths (``--seq-lens``,
a scenario's ``seq_lens``), inputs cut to each, and how often each length occurs
(``--seq-hist``), which weighs the shapes' slowdowns into the one a run sees."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError


def cut_to_length(inputs: Any, length: int, name: str = "the model") -> Any:
    """``inputs`` with every tensor whose second dimension is the sequence (that of the first
    tensor with two or more dimensions: token ids, masks, labels) cut to ``length``."""
    import torch

    tensors = [t for t in _tensors(inputs) if t.dim() >= 2]
    if not tensors:
        raise MemfitError(f"{name}: its inputs have no tensor with a sequence dimension to cut to {length}; give "
                          "--input-shape once per shape instead of --seq-lens")
    full = tensors[0].shape[1]
    if length > full:
        raise MemfitError(f"{name}: its inputs are {full} long, shorter than the sequence length {length} asked for; "
                          "make the factory's sequence longer (its seq argument), or plan for shorter lengths")

    def cut(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj[:, :length].contiguous() if obj.dim() >= 2 and obj.shape[1] == full else obj
        if isinstance(obj, dict):
            return {k: cut(v) for k, v in obj.items()}
        if isinstance(obj, tuple | list):
            return type(obj)(cut(v) for v in obj)
        return obj

    return cut(inputs)


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, tuple | list) else ()
    return [t for v in values for t in _tensors(v)]


def parse_lengths(value: str | list[Any]) -> list[int]:
    """Sequence lengths from ``512,1024`` or a list: distinct positive integers, sorted."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    try:
        lengths = [int(v) for v in items if not isinstance(v, bool | float)]
    except ValueError:
        lengths = []
    if not lengths or len(lengths) != len(items) or any(n <= 0 for n in lengths) or len(set(lengths)) != len(lengths):
        raise MemfitError(f"sequence lengths are distinct positive integers joined by commas, e.g. 512,1024,2048; "
                          f"got {value!r}")
    return sorted(lengths)


def read_histogram(path: str, lengths: list[int]) -> list[float]:
    """Each planned length's share of the steps from a CSV of ``length,count`` rows (a header
    row allowed): a length counts toward the shortest planned length that covers it, as the
    plans are picked at run time. Lengths longer than every planned one are an error."""
    counts = [0.0] * len(lengths)
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = [r for r in csv.reader(handle) if r and any(c.strip() for c in r)]
    except OSError as exc:
        raise MemfitError(f"--seq-hist {path}: cannot read it ({exc.strerror or exc})") from None
    for k, row in enumerate(rows):
        try:
            length, count = int(row[0]), float(row[1])
        except (ValueError, IndexError):
            if k == 0:
                continue  # a header
            raise MemfitError(f"--seq-hist {path}: line {k + 1} is {','.join(row)!r}; expected length,count") from None
        if length <= 0 or not count >= 0:
            raise MemfitError(f"--seq-hist {path}: line {k + 1}: a length above 0 and a count of 0 or more")
        covering = next((i for i, n in enumerate(lengths) if n >= length), None)
        if covering is None:
            raise MemfitError(f"--seq-hist {Path(path).name}: length {length} is longer than every planned one "
                              f"({max(lengths)}); plan for it too (--seq-lens) or cut such sequences")
        counts[covering] += count
    if not sum(counts):
        raise MemfitError(f"--seq-hist {path}: no counts (rows of length,count)")
    return counts
