"""When to plan the next step while one runs (CPU): late in the running step, not at its start.

With overlap the next plan is sent while the worker computes the current step, so the worker never
waits for the scheduler. Planned at the step's start, a request arriving a moment later misses that
plan and starts a whole step later: on the small model at 32 streams (30 ms steps) that third step is
a third of its time to first token. Planned most of the way through the step instead, it joins. The
step's length is estimated from the steps before it (a decode part and a cost per prompt token); when a
step ends sooner than that, its result arrives first and the next plan goes out at once, as it would
without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from crane_mp.scheduler.pacing import MIN_OBSERVED_TOKENS, smoothed


@dataclass(slots=True)
class StepClock:
    fraction: float  # of the running step's expected length after which the next is planned; 0: at once
    decode_seconds: float = 0.0  # a step without prompt tokens
    prompt_token_seconds: float = 0.0  # what each prompt token adds to a step

    def plan_delay(self, prompt_tokens: int) -> float:
        """Seconds after a step with `prompt_tokens` prompt tokens started at which to plan the next."""
        if self.fraction <= 0 or self.decode_seconds <= 0:
            return 0.0
        return self.fraction * (self.decode_seconds + prompt_tokens * self.prompt_token_seconds)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """The worker's time on a finished step that computed `prompt_tokens` prompt tokens."""
        if self.fraction <= 0 or seconds <= 0:
            return
        if prompt_tokens == 0:
            self.decode_seconds = smoothed(self.decode_seconds, seconds)
        elif prompt_tokens >= MIN_OBSERVED_TOKENS and self.decode_seconds > 0:
            per_token = max(0.0, seconds - self.decode_seconds) / prompt_tokens
            self.prompt_token_seconds = smoothed(self.prompt_token_seconds, per_token)
