"""Readers of the fields a profile and a schedule file share (the step, the device's memory,
the parallel layout) and of checked values, each raising a ``FileFormatError`` that names the field."""

from __future__ import annotations

from typing import Any

from memfit.devices import MemoryRecord
from memfit.errors import FileFormatError, MemfitError
from memfit.formats.layout import PARALLEL, ParallelLayout, check_layout
from memfit.jsonio import Fields
from memfit.trainstep import StepRecord, TrainStep


def read_memory(f: Fields) -> MemoryRecord | None:
    """A profile's or schedule's ``memory`` field: None where none was recorded (the CPU, older files)."""
    if not f.data.get("memory"):
        return None
    m = f.obj("memory")
    record = m.record(MemoryRecord, {"total_bytes": 1, "context_bytes": 0, "margin": 0.0})
    if record["context_bytes"] >= record["total_bytes"] or record["margin"] >= 1:
        raise FileFormatError(f"{m.where}: the context must be less than the total and the margin less than 1")
    return record


def read_step(f: Fields) -> StepRecord | None:
    """A profile's or schedule's ``step`` field: None for the plain step of files made before it."""
    if not f.data.get("step"):
        return None
    s = f.obj("step")
    record = s.record(StepRecord, {"accumulate": 1})
    try:
        TrainStep.from_fields(record)
    except MemfitError as exc:
        raise FileFormatError(f"{s.where}: {exc}") from None
    return record


def read_parallel(f: Fields) -> ParallelLayout | None:
    """A profile's or schedule's ``parallel`` field: None for one process."""
    if not f.data.get("parallel"):
        return None
    p = f.obj("parallel")
    layout = p.record(ParallelLayout, {"world_size": 2, "tp": 1})
    if layout["kind"] not in PARALLEL:
        raise_field(p.where, "kind", layout["kind"])
    check_layout(layout, FileFormatError)
    return layout


def choice_field(f: Fields, key: str, allowed: tuple[str, ...], default: str) -> str:
    """Field ``key``, one of ``allowed`` (``default`` where it is absent)."""
    value = f.data.get(key, default)
    if value not in allowed:
        raise_field(f.where, key, value)
    return str(value)


def positive_field(f: Fields, key: str) -> float:
    """Field ``key``, a number above 0."""
    value = f.float(key, minimum=0.0)
    if value <= 0:
        raise_field(f.where, key, value)
    return value


def raise_field(where: str, key: str, value: Any) -> None:
    """Say that field ``key`` at ``where`` holds an invalid ``value``."""
    raise FileFormatError(f"{where}: field {key!r} has an invalid value {value!r}")
