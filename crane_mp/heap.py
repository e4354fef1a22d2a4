"""Memory native libraries keep: the C library's heap (its large blocks used again, malloc_trim), and
oneDNN's kernel caches.

glibc keeps what a process freed in its arenas, so the resident size after a burst of large
short-lived allocations stays at its peak although the memory is free;
`malloc_trim(0)` gives every arena's free pages back (milliseconds for a heap of hundreds of MB, so
processes call it when they fall idle, and the worker every few seconds while busy, never per
request or step)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Callable


def libc() -> ctypes.CDLL | None:
    """The C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    return getattr(libc(), "malloc_trim", None)


# glibc's mallopt parameters (malloc.h); the most of a heap's free top kept (mallopt takes an int).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_KEPT_TOP_BYTES = 2**31 - 1


def reuse_freed_blocks() -> None:
    """Large blocks from glibc's heap, freed ones kept for the next allocation: glibc maps every block
    over 32 MB (a long prompt's per-layer activations: an 8B's gate/up output at 2,000 tokens is 98 MB)
    fresh from the kernel and unmaps it when freed, so each layer page-faulted it in again (an 8B's
    2,000-token prefill spent 4 of its 40 CPU-seconds in the kernel, and took 1.12x the time). The
    worker's malloc_trim still gives freed pages back when idle, and every few seconds while busy.
    An operator's MALLOC_MMAP_MAX_ or MALLOC_TRIM_THRESHOLD_ wins."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return
    if "MALLOC_MMAP_MAX_" not in os.environ:
        mallopt(_M_MMAP_MAX, 0)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:  # nor the heap's top cut back at every free
        mallopt(_M_TRIM_THRESHOLD, _KEPT_TOP_BYTES)


# Kernels oneDNN keeps per input shape, in ideep's cache (LRU_CACHE_CAPACITY) and oneDNN's own
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 each by default, ~1.4 MB per row count and weight shape
# (benchmarks/onednn_row_counts.py). The worker calls oneDNN with at most 27 row counts per weight
# shape (cpu_packing.py), which these hold with room for a model's few shapes.
NATIVE_CACHE_ENTRIES = "256"


def cap_native_caches() -> None:
    """Bound oneDNN's kernel caches, unless the operator set them; read when oneDNN is first used."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", NATIVE_CACHE_ENTRIES)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", NATIVE_CACHE_ENTRIES)
