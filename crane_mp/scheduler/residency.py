"""The scheduler's side of sleep, wake-up and new weights: when the worker may be told, and what waits.

The worker changes what it holds only with no request on it: a sleep is refused while requests are
queued or running (or starts by itself after --sleep-idle-seconds with none); a request that arrives
while the model sleeps waits in the queue while the worker wakes. New weights are read beside the step
loop; once they are in memory, requests not yet started wait while the ones the old weights started
(preempted ones too) finish, then the worker swaps, the prefix cache (the old weights' KV) is dropped
and the waiting requests start on the new weights: no request mixes the two.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SLEEP_LEVELS = (1, 2)


@dataclass(slots=True)
class Waiter:
    token: int
    frontend_id: int


@dataclass(slots=True)
class ResidencyState:
    weights_path: str
    idle_sleep_seconds: float = 0.0  # 0: never by itself
    idle_sleep_level: int = 1
    level: int = 0  # how deeply the worker sleeps now (0: awake)
    changing: str | None = None  # "sleep", "wake" or "swap": sent to the worker, not yet answered
    asked_level: int = 0  # the level of the sleep in flight
    pending_level: int = 0  # a sleep asked for while the last steps end: starts once they have
    sleep_waiters: list[Waiter] = field(default_factory=list)
    wake_waiters: list[Waiter] = field(default_factory=list)
    reload: Waiter | None = None  # the update_weights request in progress
    reload_path: str = ""
    reload_read: bool = False  # the new weights are in the worker's memory: drain, then swap
    last_busy: float = field(default_factory=time.monotonic)

    @property
    def steps_allowed(self) -> bool:
        """Steps need the weights and the KV cache resident, and nothing changing them."""
        return self.level == 0 and self.changing is None

    def busy_reason(self, num_requests: int) -> str | None:
        """Why the worker may not sleep (None: it may, once the steps in flight end)."""
        if self.reload is not None:
            return "new weights are being loaded"
        if self.changing == "wake":
            return "the model is waking up for a request"
        if num_requests:
            return f"{num_requests} requests are queued or running; sleep when the model is idle"
        return None

    def idle_sleep_due(self, now: float) -> bool:
        return (self.idle_sleep_seconds > 0 and self.level == 0 and self.changing is None and self.reload is None
                and not self.pending_level and now - self.last_busy >= self.idle_sleep_seconds)

    def seconds_to_idle_sleep(self, now: float) -> float | None:
        if self.idle_sleep_seconds <= 0 or self.level or self.changing or self.reload is not None:
            return None
        return max(0.0, self.last_busy + self.idle_sleep_seconds - now)
