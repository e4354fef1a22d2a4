"""Give a burst's memory back: once the frontend has been idle for a moment after serving requests,
collect garbage and return freed heap pages to the OS (glibc keeps them otherwise, and a burst of
thousands of connections would leave the frontend's RSS a tenth higher for good)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc

_IDLE_SECONDS = 1.0


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


class HeapTrimmer:
    def __init__(self) -> None:
        self.trim = _malloc_trim()
        self.pending: asyncio.TimerHandle | None = None

    def on_idle(self, is_idle) -> None:
        """Call when the last request in flight finished; trims if `is_idle()` still holds a second later."""
        if self.pending is None:
            self.pending = asyncio.get_running_loop().call_later(_IDLE_SECONDS, self._run, is_idle)

    def _run(self, is_idle) -> None:
        self.pending = None
        if is_idle():
            gc.collect()
            if self.trim is not None:
                self.trim(0)
