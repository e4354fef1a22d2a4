"""How many prompt tokens one step may compute, so that a step lasts about a target time (CPU).

On a CPU a large model computes prompts slowly: an 8B model on two cores takes ~0.1 s per prompt
token, so a 512-token chunk is a 50 s step, through which every running stream stalls and every
request that arrived meanwhile waits. Paced, each step takes the prompt tokens that fit its target
time: the first request of a burst streams after its own prompt, not after everyone's, and running
streams advance between chunks. A prompt alone is not paced (smaller chunks would only re-read the
weights more often). The pace (seconds per prompt token) starts from the worker's warm-up and follows
the step times the worker reports.

A paced step beside others also takes at most 256 prompt tokens, which is what binds a small model: a
burst of prompts starts streaming a few at a time instead of in two or three budget-sized steps, and
the prompts that arrive as the first ones finish meet short steps (the small benchmark model, 32 streams
of 128-token prompts: TTFT p50 0.18-0.22 s against 0.58-0.71 s with the whole budget a step;
benchmarks/RESULTS.md). A short queue (at most twice that) is taken whole instead: a few prompts left
behind by a step would otherwise trail every later arrival for as long as requests keep coming two a
step, each one step late.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps with fewer prompt tokens say more about the weights' bandwidth than about prompt cost.
MIN_OBSERVED_TOKENS = 8
# The most prompt tokens a paced step beside others takes, whatever the pace allows.
_CONTENDED_TOKENS = 256
# Prompt tokens left to compute up to which a paced step takes them all (within the pace's target).
SHORT_QUEUE_TOKENS = 2 * _CONTENDED_TOKENS
_SMOOTHING = 0.3


@dataclass(slots=True)
class PrefillPace:
    target_seconds: float  # a step's prompt share; 0 turns pacing off (CUDA: steps are short)
    seconds_per_token: float  # current estimate; 0 = unknown, no limit until a step says

    def token_cap(self, block_size: int, pending_tokens: int) -> int | None:
        """Prompt tokens a step beside others may take (at least a block), or None for no limit (unpaced).
        `pending_tokens`: prompt tokens the running and waiting requests have left to compute."""
        if self.target_seconds <= 0:
            return None
        cap = pending_tokens if _CONTENDED_TOKENS < pending_tokens <= SHORT_QUEUE_TOKENS else _CONTENDED_TOKENS
        if self.seconds_per_token > 0:
            cap = min(cap, int(self.target_seconds / self.seconds_per_token))
        return max(block_size, cap)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A finished step that computed `prompt_tokens` prompt tokens in `seconds`."""
        if self.target_seconds <= 0 or prompt_tokens < MIN_OBSERVED_TOKENS or seconds <= 0:
            return
        self.seconds_per_token = smoothed(self.seconds_per_token, seconds / prompt_tokens)


def smoothed(current: float, measured: float) -> float:
    """An estimate moved part of the way to a new measurement (the first one taken as it is)."""
    return measured if current <= 0 else current + _SMOOTHING * (measured - current)
