"""Give a burst's memory back: once the frontend has been idle for a moment after serving requests,
collect garbage and return freed heap pages to the OS (glibc keeps them otherwise, and a burst of
thousands of connections would leave the frontend's RSS a tenth higher for good)."""

from __future__ import annotations

import asyncio
import gc

from crane_mp.heap import malloc_trim

_IDLE_SECONDS = 1.0


class HeapTrimmer:
    def __init__(self) -> None:
        self.trim = malloc_trim()
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
