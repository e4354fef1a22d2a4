"""A request as the scheduler sees it: token ids, progress, blocks, and finish rules by token id."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from crane_mp.protocol import FinishReason, MediaInput, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True)
class Request:
    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0  # wall clock (time.time()) when the frontend received it
    queue_time: float | None = None  # seconds from arrival to first being scheduled
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is computed or being computed by a planned step
    num_pending: int = 0  # tokens a planned step samples that have not come back yet (overlap)
    block_ids: list[int] = field(default_factory=list)  # KV group 0's block table
    # The block tables of KV groups 1, 2, ... (models/kv_groups.py), as long as block_ids; a sliding group's
    # blocks before its window are the pool's spare id (nothing held).
    group_block_ids: list[list[int]] = field(default_factory=list)
    window_start: list[int] = field(default_factory=list)  # per group: blocks before it were released
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full blocks so far
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the id that ended the request, reported as stop_reason
    known_to_worker: bool = False
    blocks_reset: bool = False  # block table must be resent whole (after preemption)
    num_preemptions: int = 0
    media: list[MediaInput] = field(default_factory=list)  # images of the prompt, or a Whisper window's audio

    @property
    def num_tokens(self) -> int:
        """Tokens the request has, counting the ones a planned step is still sampling."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def prompt_tokens_left(self) -> int:
        """Tokens a prefill (or a resumed request's recompute) has still to compute; 0 for a decode row,
        which has at most its newest token."""
        left = self.num_tokens - self.num_computed_tokens
        return left if left > 1 else 0

    @property
    def known_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_key_ids(self) -> list:
        """known_token_ids as the prefix cache tells them apart: an image's first placeholder stands for
        its content, so prompts equal in tokens but holding different images never share KV."""
        if not any(item.num_tokens for item in self.media):
            return self.known_token_ids
        ids: list = self.known_token_ids
        for item in self.media:
            if item.num_tokens:
                ids[item.offset] = (item.kind, item.key)
        return ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

