"""The one generation pipeline every API adapter ends in.

An adapter (OpenAI chat and completions, SGLang /generate, embeddings) turns its body into a `Plan`:
token ids per prompt (through `prompt_ids`, which holds the prompt-room rule), sampling, how many
samples, the output budget, stop strings and names. `serve` then does what every API shares: each
prompt's max_tokens within the context window, submission, admission before a stream answers 200,
streaming through the one SSE writer or collecting for one JSON body, aborts when the client leaves,
and errors as HTTP statuses (errors.py). What differs per API is only its `Renderer`.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from aiohttp import web

from crane_mp.frontend.serving.choices import (
    Collected,
    admitted,
    collect,
    merged_deltas,
    open_choices,
    resolve_max_tokens,
)
from crane_mp.frontend.serving.generation import Delta, Generation
from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.web.errors import ApiError, GenerationError, error_body
from crane_mp.frontend.web.http import SSE_DONE, SSE_HEADERS, json_response, sse_event
from crane_mp.protocol import MediaInput, SamplingParams

log = logging.getLogger("crane_mp.frontend")
# Prompt logprobs are held in the frontend until the response is built (each entry a few Python
# objects, ~100 bytes): bounded per request. lm-eval-harness's scoring (a 2k-token context, top 1) takes
# 4k; the bound is a batch of 64 of those, eight times over.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 21


async def prompt_ids(state: FrontendState, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt as token ids: text is tokenized and must leave room for one output token (a 400 naming
    `param` otherwise); token ids are used as given (no BOS added), their length checked by `serve`."""
    if not isinstance(prompt, str):
        return prompt
    return await state.tokenizer.encode(prompt, state.engine_info.max_model_len - 1, param, add_special_tokens)


@dataclass(slots=True)
class Plan:
    """What one API request asks of the engine. `max_tokens`: the output budget asked for (None: all the
    room the context window leaves); 0 scores the prompt alone, the engine making one token that no
    one sees. `param`: the body field the prompts came from, which a too-long prompt's 400 names."""

    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: int | None
    param: str
    n: int = 1
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    names: str | list[str] | None = None  # what /abort_request may call the generations
    lora_ids: list[int] | None = None  # per prompt, where prompts use different adapters
    media: list[MediaInput] | None = None  # the images of a single prompt
    skip_ids: frozenset[int] | None = None  # the special tokens dropped, where some are kept (Detokenizer)


class EventStream(Protocol):
    """A streamed response's shape: `chunks` per delta, then `closing` (e.g. a usage chunk), each
    payload one SSE event. OpenAI's chat and completions write data-only events and `data: [DONE]`;
    an API with named events (Responses, Anthropic) also has `event_bytes(payload)`, `end_bytes`
    (what ends the stream) and `error_payload(status, message)` for a failure after the 200."""

    def chunks(self, index: int, delta: Delta) -> list[Any]: ...

    def closing(self) -> list[Any]: ...


# A response body from every choice's collected output.
BodyMaker = Callable[[list[Collected]], Any]


async def serve(request: web.Request, state: FrontendState, plan: Plan,
                render: Callable[[list[Generation]], EventStream | BodyMaker]) -> web.StreamResponse:
    """Run `plan` and answer with what `render(generations)` gives: an event stream, or the maker of one
    JSON body."""
    _check_size(state, plan)
    hidden = plan.max_tokens == 0
    requested = 1 if hidden else plan.max_tokens
    budgets = [resolve_max_tokens(state, len(prompt), requested, plan.param) for prompt in plan.prompts]
    async with open_choices(state, plan.prompts, plan.n, plan.params, budgets, plan.stop or [],
                            plan.skip_special_tokens, discard_output=hidden, names=plan.names,
                            lora_ids=plan.lora_ids, media=plan.media, skip_ids=plan.skip_ids) as gens:
        rendered = render(gens)
        if callable(rendered):
            return json_response(rendered(await collect(gens)))
        return await _write_sse(request, gens, rendered, state.config.write_timeout)


def _check_size(state: FrontendState, plan: Plan) -> None:
    """Bounded work per request: one request may not fill the queue by itself, nor hold n copies of its
    prompt's logprobs."""
    generations, limit = len(plan.prompts) * plan.n, state.config.max_request_generations
    if generations > limit:
        raise ApiError(400, f"this request would start {generations} generations ({len(plan.prompts)} prompts x "
                            f"n={plan.n}); at most {limit} (--max-request-generations)", "n")
    top = plan.params.prompt_logprobs
    if top is None:
        return
    if plan.n > 1:
        raise ApiError(400, "prompt logprobs (echo or logprob_start_len) cannot be combined with n > 1", "n")
    entries = sum(len(prompt) for prompt in plan.prompts) * (1 + top)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ApiError(400, f"prompt logprobs for these prompts would hold {entries} entries (prompt tokens x "
                            f"(1 + top logprobs)); at most {MAX_PROMPT_LOGPROB_ENTRIES}: ask for fewer top "
                            "logprobs or send fewer prompts per request", plan.param)


async def _write_sse(request: web.Request, gens: list[Generation], renderer: EventStream,
                     write_timeout: float) -> web.StreamResponse:
    """200 once every generation is admitted (a refusal is still an HTTP status), then the renderer's
    events as deltas arrive and `data: [DONE]`; a failure after the 200 is an error event. A client
    that leaves its events unread for `write_timeout` seconds is dropped: the connection closes and,
    on the way out of open_choices, its generations are aborted."""
    await admitted(gens)
    encode = getattr(renderer, "event_bytes", sse_event)
    failure = getattr(renderer, "error_payload", error_body)
    end = getattr(renderer, "end_bytes", SSE_DONE)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)

    async def send(data: bytes) -> None:
        async with asyncio.timeout(write_timeout):
            await response.write(data)

    try:
        try:
            async with aclosing(merged_deltas(gens)) as deltas:
                async for index, delta in deltas:
                    for payload in renderer.chunks(index, delta):
                        await send(encode(payload))
            for payload in renderer.closing():
                await send(encode(payload))
        except GenerationError as err:
            await send(encode(failure(err.status, str(err))))
        if end:
            await send(end)
    except TimeoutError:
        log.warning("a streaming client read nothing for %g s (--write-timeout); dropped it", write_timeout)
        if request.transport is not None:
            request.transport.abort()
        return response
    await response.write_eof()
    return response
