"""Memory sizes: parsing "24GB" and printing bytes. All units are binary (GB == GiB == 2**30)."""

from __future__ import annotations

import math
import re

from memfit.errors import BudgetFormatError, MemfitError

_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
# The unit letter and the "i" may be of either case; "B" must be upper case ("b" is bits).
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTkmgt]?)([iI]?)([Bb]?)\s*$")


def parse_share(text: str) -> float | None:
    """``"60%"`` -> 0.6: a budget as a share of the unplanned peak (as torch.compile's
    ``activation_memory_budget`` is a fraction); None for a size."""
    if not isinstance(text, str) or not text.strip().endswith("%"):
        return None
    try:
        value = float(text.strip()[:-1])
    except ValueError:
        raise BudgetFormatError(f"cannot read the share {text!r}: write a percentage such as 60%") from None
    if not 0 < value <= 100:
        raise BudgetFormatError(f"a budget share must be more than 0% and at most 100% of the unplanned peak, "
                                f"got {text!r}")
    return value / 100


def parse_bytes(text: str | int | float) -> int:
    """Parse a size such as ``24GB``, ``24GiB``, ``24G``, ``1536MB``, ``0.5TB`` or ``1000`` (bytes).

    GPU memory is sold and reported in powers of two, so ``GB`` means GiB here.
    """
    if isinstance(text, bool):
        raise BudgetFormatError(f"not a memory size: {text!r}")
    match = None
    if isinstance(text, (int, float)):
        value, power = float(text), 0
    else:
        if text.strip().startswith("-"):
            raise BudgetFormatError(f"a memory size must be positive, got {text!r}")
        match = _PATTERN.match(text)
        if match is None:
            raise BudgetFormatError(
                f"cannot read the memory size {text!r}: write a number with an optional unit, "
                "e.g. 24GB, 24GiB, 24G, 1536MB, 0.5TB or 1000 (bytes)"
            )
        value = float(match.group(1))
        unit, binary, byte = match.group(2).upper(), match.group(3), match.group(4)
        if byte == "b":
            raise BudgetFormatError(
                f"{text!r} is in bits (lower-case b); memory sizes are bytes: write {match.group(1)}{unit}{binary}B"
            )
        if binary and not unit:
            raise BudgetFormatError(f"cannot read the memory size {text!r}: 'i' needs a unit letter, e.g. 24GiB")
        power = _POWERS[unit]
    result = value * (1024**power)
    if not math.isfinite(result):
        raise BudgetFormatError(f"the memory size {text!r} is too large")
    if result <= 0:
        raise BudgetFormatError(f"a memory size must be positive, got {text!r}")
    if result < 1:
        number = match.group(1) if isinstance(text, str) and match is not None else str(text)
        raise BudgetFormatError(f"{text!r} is less than one byte (a bare number is bytes); did you mean {number}GB?")
    return math.floor(result)


def format_bytes(n: float, *, signed: bool = False) -> str:
    """Print bytes as ``1.23 GiB`` / ``456.7 MiB`` / ``12.0 KiB`` / ``512 B``."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    a = abs(n)
    for unit, power in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if a >= 1024**power:
            return f"{sign}{a / 1024**power:.2f} {unit}"
    return f"{sign}{a:.0f} B"


def budget_range(text: str) -> list[int]:
    """``START:STOP:STEP`` (both ends included when the steps land on STOP) or ``A,B,C``."""
    if "," in text or ":" not in text:
        return [parse_bytes(t) for t in text.split(",") if t.strip()] or _bad_range(text)
    parts = text.split(":")
    if len(parts) != 3:
        _bad_range(text)
    start, stop, step = (parse_bytes(p) for p in parts)
    if start > stop:
        raise MemfitError(f"--budgets {text}: the start is above the stop")
    count = (stop - start) // step + 1
    if count > 1000:
        raise MemfitError(f"--budgets {text} makes {count} budgets; at most 1000 (take a larger step)")
    return [start + k * step for k in range(count)]


def _bad_range(text: str) -> list[int]:
    raise MemfitError(f"--budgets is START:STOP:STEP such as 100MB:500MB:20MB, or a list such as 200MB,300MB; "
                      f"got {text!r}")
