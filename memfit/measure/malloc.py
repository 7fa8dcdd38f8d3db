"""glibc's malloc settings for steady CPU step times; apart from memory.py so that the CLI sets
them without importing torch."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def keep_freed_cpu_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel.

    By default glibc returns large freed blocks at once, so every training step faults the pages
    of its activations in afresh: measured here, a fifth of a CPU step of the default scenario,
    and less of it the more is checkpointed, so recompute costs looked different in every
    schedule. Kept memory behaves like CUDA's caching allocator: steps are faster and their
    times add up. The memfit command and the benchmarks call this; call it at the start of a CPU
    training script for the same speed. Process-wide; returns False where it cannot apply
    (not glibc). Freed memory stays with the process up to its peak.
    """
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    return bool(
        mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest: blocks up to 32 MiB come from the heap
        and mallopt(m_trim_threshold, 2**31 - 1)  # never trim the heap's free top
        and mallopt(m_top_pad, 64 << 20)  # grow the heap in 64 MiB steps
    )
