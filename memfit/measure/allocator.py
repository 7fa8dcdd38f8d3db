"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, default
settings: no ``expandable_segments``, no ``max_split_size_mb``, one stream), to predict what a
step *reserves* from the sizes and order of what it allocates and frees, instead of a fixed
margin over the allocated peak.

The rules it follows: a request is rounded up to 512 bytes; requests up to 1 MiB come from the
small pool, the rest from the large one; a free block is reused best-fit (the smallest that
holds the request, lowest address first) and split when what is left is at least 512 bytes
(small pool) or more than 1 MiB (large pool); with none free, a new segment is reserved: 2 MiB
for a small request, 20 MiB for a large one under 10 MiB, else the request rounded up to 2 MiB;
a freed block merges with free neighbours of its segment, and segments are never given back
(``empty_cache`` is not called in a training loop). Reserved bytes are the segments' total.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20
MIN_BLOCK = 512
SMALL_SIZE = MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True, eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return self.size, self.segment, self.offset


@dataclass(slots=True)
class CachingAllocator:
    """Reserved and allocated bytes of a sequence of ``malloc(key, size)`` and ``free(key)``."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    _segments: int = 0
    _pools: dict[bool, list[tuple[tuple[int, int, int], _Block]]] = field(
        default_factory=lambda: {True: [], False: []})
    _live: dict[object, _Block] = field(default_factory=dict)

    def malloc(self, key: object, size: int) -> None:
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, ((size, -1, -1),))
        if i < len(pool):
            block = pool.pop(i)[1]
        else:
            block = _Block(self._segments, 0, segment_size(size), small)
            self._segments += 1
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.segment, block.offset + size, rest, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            bisect.insort(pool, (tail.key(), tail))
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        pool = self._pools[block.small]
        for other in (block.prev, block.next):
            if other is not None and other.free:
                pool.pop(self._index(pool, other))
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        bisect.insort(pool, (block.key(), block))

    @staticmethod
    def _index(pool: list[tuple[tuple[int, int, int], _Block]], block: _Block) -> int:
        i = bisect.bisect_left(pool, (block.key(),))
        while pool[i][1] is not block:
            i += 1
        return i


def replay(trace: Iterable[Mapping[str, Any]]) -> CachingAllocator:
    """The model run over a recorded CUDA allocator trace: the entries of
    ``torch.cuda.memory._snapshot()["device_traces"][i]`` (recorded with
    ``torch.cuda.memory._record_memory_history``), keyed by address. ``alloc`` and
    ``free_completed`` are the allocator's own; segment events are its answers, which the model
    computes (benchmarks/allocator_check.py sets the two side by side on a GPU)."""
    model = CachingAllocator()
    for entry in trace:
        if entry["action"] == "alloc":
            model.malloc(entry["addr"], entry["size"])
        elif entry["action"] == "free_completed":
            model.free(entry["addr"])
    return model
