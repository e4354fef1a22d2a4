"""Every message that crosses a process boundary, as msgspec Structs; nothing else goes over a socket.

Grouped by receiver. Hot-path structs are `array_like` (encoded as msgpack arrays, no field names).
The in-process engine passes the same objects without encoding them.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Per-request generation settings. The worker samples with them; the scheduler stops by token id.

    top_k <= 0 disables top-k; logprobs None returns no logprobs, N >= 0 the sampled token's plus top N.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# ---- scheduler -> worker ------------------------------------------------------------------------


class NewRequest(msgspec.Struct, array_like=True):
    """Sent once, the first step a request runs; the worker keeps a mirror until told it finished."""

    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams


class ScheduledRequest(msgspec.Struct, array_like=True):
    """Compute tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of a request this step.

    `new_block_ids` extend the worker's block table; after a preemption `reset_blocks` replaces it.
    The worker samples a token for the request when the span reaches the end of its known tokens.
    """

    req_id: int
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int]
    reset_blocks: bool = False


class StepPlan(msgspec.Struct, array_like=True):
    step_id: int
    new_requests: list[NewRequest]
    scheduled: list[ScheduledRequest]
    preempted_req_ids: list[int]  # KV freed; the worker keeps tokens and sampling state
    finished_req_ids: list[int]  # drop every trace of these


# ---- worker -> scheduler ------------------------------------------------------------------------


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class StepResult(msgspec.Struct, array_like=True):
    """One sampled token for each scheduled request whose span reached its end, in plan order."""

    step_id: int
    req_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []  # empty unless some request asked for logprobs
