"""The load-shedding gate: past --max-concurrent + --max-queue generation requests in progress on this
frontend, the scheduler would refuse anyway, so a request is refused here with 429 before it costs
tokenization. It is counted only once its body arrived and parsed: a client that trickles its upload
holds a connection, never a place another request needs."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.heap import HeapTrimmer


class LoadGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0  # generation requests being served
        self._trimmer = HeapTrimmer()

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        if self.in_flight >= self.limit:
            raise ApiError(429, f"the server is overloaded: {self.in_flight} requests in progress "
                                "(--max-concurrent + --max-queue); retry later")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:  # idle: give freed memory back to the OS (heap.py)
                self._trimmer.on_idle(lambda: not self.in_flight)
