"""Drive one request through the engine and turn its tokens into text: the part every API shares.

`Generation.deltas()` yields text deltas as tokens arrive (coalesced when the consumer is slow) and
ends with the finish; a matched stop string aborts the engine request at once. If iteration stops
early (client gone, cancelled), the request is aborted so its KV blocks come back. Nothing here knows
the HTTP request: access_log.py records generations and imports this module, never the reverse.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from crane_mp.frontend.serving.detokenizer import Detokenizer
from crane_mp.frontend.serving.engine_client import EngineClient, RequestStream
from crane_mp.frontend.web.errors import GenerationError
from crane_mp.protocol import ErrorKind, FinishReason, PromptLogprobs, TokenLogprobs

FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
# How the metrics name a request that ended with an error, by why.
_ERROR_FINISH_NAMES = {ErrorKind.TIMEOUT: "timeout", ErrorKind.OVERLOADED: "rejected"}


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: int | str | None = None  # matched stop token id or stop string (vLLM's stop_reason)


@dataclass(slots=True)
class Generation:
    """A request in flight; iterate `deltas()` once. `discard_output` serves echo-only scoring
    (max_tokens=0): the engine must produce a token, the client never sees it."""

    client: EngineClient
    stream: RequestStream
    detokenizer: Detokenizer
    discard_output: bool = False
    done: bool = False  # the engine finished the request (or was told to abort it)
    closed: bool = False  # unregistered from the client, finish recorded
    finish_name: str = "abort"  # what the metrics record if the request ends without a finish
    last_token_time: float | None = None
    request_id: str = ""  # the HTTP request's id, quoted in internal errors

    @property
    def rid(self) -> int:
        return self.stream.rid

    @property
    def prompt_tokens(self) -> int:
        return self.stream.num_prompt_tokens

    @property
    def completion_tokens(self) -> int:
        if self.discard_output:
            return 0
        if self.detokenizer.matched_stop is not None:
            return self.detokenizer.num_tokens
        return len(self.stream.token_ids)

    @property
    def cached_tokens(self) -> int:
        return self.stream.cached_tokens

    @property
    def prompt_logprobs(self) -> list[PromptLogprobs]:
        return self.stream.prompt_logprobs

    @property
    def embedding(self) -> bytes | None:
        return self.stream.embedding

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            while True:
                new_ids = await self.stream.next_tokens()
                if self.stream.error is not None:
                    raise self.error()
                self._observe_tokens(len(new_ids))
                first = self.stream.num_consumed - len(new_ids)
                if self.discard_output:
                    new_ids = []
                text = self.detokenizer.add(new_ids)
                if self.detokenizer.matched_stop is not None:
                    # Tokens after the one that completed the stop string are not part of the output.
                    kept = self.detokenizer.num_tokens - first
                    await self.client.abort(self.rid)
                    self.done, self.finish_name = True, "stop"
                    yield Delta(text, new_ids[:kept], self._logprobs(first, kept), "stop", self.detokenizer.matched_stop)
                    return
                logprobs = self._logprobs(first, len(new_ids))
                if self.stream.finished:
                    reason = FINISH_NAMES[FinishReason(self.stream.finish_reason)]
                    self.done, self.finish_name = True, reason
                    text += self.detokenizer.finish()
                    yield Delta(text, new_ids, logprobs, reason, self.stream.stop_token_id)
                    return
                if text or new_ids:
                    yield Delta(text, new_ids, logprobs)
        finally:
            await self.close()

    def error(self) -> GenerationError:
        stream = self.stream
        self.done = True  # the engine has finished with it (refused, failed, timed out: already aborted)
        self.finish_name = _ERROR_FINISH_NAMES.get(stream.error_kind, "error")
        message = stream.error
        if stream.error_kind == ErrorKind.INTERNAL and self.request_id:
            message += f" (request id {self.request_id})"
        return GenerationError(message, stream.error_kind)

    async def admitted(self) -> None:
        """Wait until the scheduler accepted the request; raises GenerationError if it refused it."""
        await self.stream.wait_admitted()
        if self.stream.error is not None:
            raise self.error()

    def unregister(self) -> bool:
        """Forget the request here and record how it ended; True when the engine must still be told to
        abort it. Idempotent, and synchronous, so no cancellation can stop it half-way."""
        if self.closed:
            return False
        self.closed = True
        self.client.release(self.rid)
        self._record_finish()
        running, self.done = not self.done, True
        return running

    async def close(self) -> None:
        """unregister(), then the abort; the abort is sent even if the caller is being cancelled."""
        if self.unregister():
            await asyncio.shield(self.client.abort(self.rid))

    def _observe_tokens(self, count: int) -> None:
        now = time.monotonic()
        if count and self.client.metrics is not None and self.last_token_time is not None:
            self.client.metrics.observe_tokens(now - self.last_token_time, count)
        if count:
            self.last_token_time = now

    def _record_finish(self) -> None:
        metrics = self.client.metrics
        if metrics is None:
            return
        stream = self.stream
        ttft = None if stream.first_token_time is None else stream.first_token_time - stream.submitted
        metrics.request_finished(self.finish_name, self.prompt_tokens, self.completion_tokens, ttft,
                                 time.monotonic() - stream.submitted, stream.queue_time)

    def _logprobs(self, first: int, count: int) -> list[TokenLogprobs | None]:
        return self.stream.logprobs[first : first + count] if self.stream.logprobs else []
