"""How a plan's ranks hold the model (``ParallelLayout``): FSDP2, DDP or tensor parallelism, on how
many ranks, and the checks that refuse a layout memfit cannot plan. Profiles and schedules carry
it (formats/profile.py reads it from a file)."""

from __future__ import annotations

from typing import TypedDict

from memfit.errors import MemfitError

# per-rank profiles: FSDP2 (fully_shard per unit and the root; fsdp-bf16 with a MixedPrecisionPolicy
# of bf16 parameters and fp32 gradient reduction), DDP, or tensor parallelism by the model's own plan
PARALLEL = ("fsdp", "fsdp-bf16", "ddp", "tp")


class _Ranks(TypedDict):
    kind: str  # one of PARALLEL
    world_size: int


class ParallelLayout(_Ranks, total=False):
    """A plan per rank: how the ranks hold the model. FSDP2 with ``tp`` > 1 is a 2-D mesh, as
    torchtitan names it: ``world_size / tp`` data-parallel shards (its
    ``data_parallel_shard_degree``) of ``tp`` tensor-parallel ranks (``tensor_parallel_degree``)."""

    tp: int  # ranks per tensor-parallel group; absent: 1 (kind "tp": every rank)
    sequence_parallel: bool  # norms and residuals sharded along the sequence (with tp)


def layout_of(kind: str, world_size: int, tp: int = 1, sequence_parallel: bool = False) -> ParallelLayout:
    """A checked layout; ``tp`` and ``sequence_parallel`` are written only where they say something."""
    layout = ParallelLayout(kind=kind, world_size=world_size)
    if tp != 1 and (kind != "tp" or tp != world_size):
        layout["tp"] = tp  # for kind tp, check_layout refuses any but world_size
    if sequence_parallel:
        layout["sequence_parallel"] = True
    check_layout(layout)
    return layout


def tp_degree(layout: ParallelLayout | None) -> int:
    """Ranks that split each product of the model between them (1: none)."""
    if not layout:
        return 1
    return int(layout["world_size"]) if layout["kind"] == "tp" else int(layout.get("tp", 1))


def dp_degree(layout: ParallelLayout | None) -> int:
    """Ranks that hold different batches (FSDP2's shards, DDP's replicas)."""
    return int(layout["world_size"]) // tp_degree(layout) if layout else 1


def describe_layout(layout: ParallelLayout) -> str:
    """``fsdp-bf16 8 x tp 8 (sequence parallel) on 64 ranks``, ``tp on 2 ranks``."""
    tp, sp = tp_degree(layout), " (sequence parallel)" if layout.get("sequence_parallel") else ""
    if layout["kind"] == "tp":
        return f"tp{sp} on {layout['world_size']} ranks"
    if tp > 1:
        return f"{layout['kind']} {dp_degree(layout)} x tp {tp}{sp} on {layout['world_size']} ranks"
    return f"{layout['kind']} on {layout['world_size']} ranks"


def check_layout(layout: ParallelLayout, error: type[Exception] = MemfitError) -> None:
    """Refuse a layout memfit cannot plan: fewer than two ranks, a tensor-parallel degree that does
    not divide them, sequence parallelism without tensor parallelism, or tp beside DDP."""
    kind, ranks, tp = layout["kind"], int(layout["world_size"]), int(layout.get("tp", 1))
    if kind not in PARALLEL:
        raise error(f"unknown parallelism {kind!r}; use one of {', '.join(PARALLEL)}")
    if ranks < 2:
        raise error(f"--world-size must be at least 2 for {kind}, got {ranks}")
    if "tp" in layout and kind == "tp" and tp != ranks:
        raise error(f"--parallel tp splits every product over all {ranks} ranks; for a 2-D mesh use --parallel fsdp "
                    f"(or fsdp-bf16) with --tp {tp}")
    if kind == "ddp" and tp > 1:
        raise error("--tp works with --parallel fsdp, fsdp-bf16 or tp, not ddp")
    if tp < 1 or ranks % tp or (kind != "tp" and "tp" in layout and tp == ranks):
        raise error(f"--tp {tp} must divide the {ranks} ranks and leave at least 2 data-parallel shards "
                    "(for tensor parallelism over every rank use --parallel tp)")
    if layout.get("sequence_parallel") and tp_degree(layout) < 2:
        raise error("--sequence-parallel shards along the sequence between tensor-parallel ranks: give --tp "
                    "(or --parallel tp)")
