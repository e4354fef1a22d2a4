"""Drive one request through the engine and turn its tokens into text: the part every API shares.

`generate_deltas` yields text deltas as tokens arrive (coalesced when the consumer is slow) and ends
with the finish; a matched stop string aborts the engine request at once. The caller's `finally`
aborts the request if iteration stops early (client gone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from crane_mp.frontend.detokenizer import Detokenizer
from crane_mp.frontend.engine_client import EngineClient, RequestStream
from crane_mp.protocol import FinishReason, SamplingParams

FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class GenerationError(RuntimeError):
    """The engine ended the request with an error (rejected at admission, or the engine died)."""


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: int | str | None = None  # matched stop token id or stop string (vLLM's stop_reason)


@dataclass(slots=True)
class Generation:
    """A request in flight; iterate `deltas()` once."""

    client: EngineClient
    stream: RequestStream
    detokenizer: Detokenizer
    done: bool = False

    @property
    def rid(self) -> int:
        return self.stream.rid

    @property
    def prompt_tokens(self) -> int:
        return self.stream.num_prompt_tokens

    @property
    def completion_tokens(self) -> int:
        if self.detokenizer.matched_stop is not None:
            return self.detokenizer.num_tokens
        return len(self.stream.token_ids)

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            while True:
                new_ids = await self.stream.next_tokens()
                if self.stream.error is not None:
                    raise GenerationError(self.stream.error)
                text = self.detokenizer.add(new_ids)
                if self.detokenizer.matched_stop is not None:
                    await self.client.abort(self.rid)
                    self.done = True
                    yield Delta(text, new_ids, "stop", self.detokenizer.matched_stop)
                    return
                if self.stream.finished:
                    self.done = True
                    reason = FinishReason(self.stream.finish_reason)
                    yield Delta(text + self.detokenizer.finish(), new_ids, FINISH_NAMES[reason], self.stream.stop_token_id)
                    return
                if text or new_ids:
                    yield Delta(text, new_ids)
        finally:
            if not self.done:
                await self.client.abort(self.rid)
            self.client.release(self.rid)


async def start_generation(
    client: EngineClient,
    backend,
    input_ids: list[int],
    sampling: SamplingParams,
    stop: list[str],
    skip_special_tokens: bool = True,
) -> Generation:
    rid = client.new_rid()
    stream = await client.submit(rid, input_ids, sampling)
    return Generation(client, stream, Detokenizer(backend, input_ids, stop, skip_special_tokens))
