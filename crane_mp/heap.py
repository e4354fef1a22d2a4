"""The C library's malloc_trim: glibc keeps what a process freed in its arenas, so the resident size
after a burst of large short-lived allocations stays at its peak although the memory is free;
`malloc_trim(0)` gives every arena's free pages back (milliseconds for a heap of hundreds of MB, so
processes call it when they fall idle, never per request or step)."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
