"""Several generations behind one response: every prompt times `n`, in OpenAI's choice order.

Each is submitted here and registered with the access record of the HTTP request being served.
Choice index = prompt index * n + sample index. Non-streaming collects them concurrently;
streaming merges their deltas as they come. Leaving early (client gone) aborts every one: every
delta iterator is closed explicitly (aclosing), not whenever the garbage collector gets to it.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec

from crane_mp.frontend.serving.detokenizer import Detokenizer
from crane_mp.frontend.serving.engine_client import EngineClient
from crane_mp.frontend.serving.generation import Delta, Generation
from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.web.access_log import current_record
from crane_mp.frontend.web.errors import ApiError, EngineDeadError, GenerationError
from crane_mp.protocol import MediaInput, SamplingParams, TokenLogprobs


@dataclass(slots=True)
class Collected:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def resolve_max_tokens(state: FrontendState, num_prompt_tokens: int, requested: int | None, param: str) -> int:
    """The one max_tokens rule: the request's budget clamped to what the context window leaves after
    the prompt (as SGLang and llama.cpp do), or all of it when none was asked for. A prompt that
    fills the window is a 400 that gives the counts."""
    limit = state.engine_info.max_model_len
    if num_prompt_tokens >= limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                            f"{num_prompt_tokens} tokens", param)
    room = limit - num_prompt_tokens
    return room if requested is None else min(requested, room)


async def start_generation(
    client: EngineClient,
    backend,
    input_ids: list[int],
    sampling: SamplingParams,
    stop: list[str],
    skip_special_tokens: bool = True,
    discard_output: bool = False,
    names: list[str] | None = None,
    media: list[MediaInput] | None = None,
    skip_ids: frozenset[int] | None = None,
) -> Generation:
    """Submit one request. `names`: what the client may call it in /abort_request; the access log
    of the HTTP request being served (if any) records it. `media`: its images or audio window."""
    rid = client.new_rid()
    record = current_record()
    names = list(names or [])
    if record is not None:
        names.append(record.request_id)
    stream = await client.submit(rid, input_ids, sampling, names, media)
    gen = Generation(client, stream, Detokenizer(backend, input_ids, stop, skip_special_tokens, skip_ids),
                     discard_output)
    if record is not None:
        gen.request_id = record.request_id
        record.add(gen, input_ids)
    return gen


@asynccontextmanager
async def open_choices(
    state: FrontendState,
    prompts: list[list[int]],
    n: int,
    base: SamplingParams,
    max_tokens: list[int],
    stop: list[str],
    skip_special_tokens: bool,
    discard_output: bool = False,
    names: str | list[str] | None = None,
    lora_ids: list[int] | None = None,
    media: list[MediaInput] | None = None,
    skip_ids: frozenset[int] | None = None,
) -> AsyncIterator[list[Generation]]:
    """Submit every prompt n times (prompt i with max_tokens[i]; a seeded request gives sample j the
    seed + j) and yield the generations. `names`: what /abort_request may call them, one for all or
    one per generation; `lora_ids`: prompt i's LoRA adapter, where prompts use different ones; `media`:
    the images of a single prompt.
    However the body ends (finished, error, client gone), every generation still
    registered is aborted and unregistered on the way out."""
    gens: list[Generation] = []
    try:
        for index, (prompt_ids, budget) in enumerate(zip(prompts, max_tokens)):
            lora_id = base.lora_id if lora_ids is None else lora_ids[index]
            for i in range(n):
                name = names if names is None or isinstance(names, str) else names[len(gens)]
                seed = None if base.seed is None else base.seed + i
                params = msgspec.structs.replace(
                    base, seed=seed, max_tokens=budget, min_tokens=min(base.min_tokens, budget), lora_id=lora_id
                )
                try:
                    gens.append(await start_generation(
                        state.client, state.tokenizer.backend, prompt_ids, params, stop, skip_special_tokens,
                        discard_output, [name] if name else None, media, skip_ids,
                    ))
                except EngineDeadError as err:
                    raise ApiError(503, f"the engine stopped: {err}") from err
        yield gens
    finally:
        # Every generation is unregistered before the first await, and the aborts go out together,
        # shielded: a cancellation or a failing send here cannot leave one behind.
        running = [gen.rid for gen in gens if gen.unregister()]
        if running:
            await asyncio.shield(asyncio.gather(*(state.client.abort(rid) for rid in running), return_exceptions=True))


async def collect(gens: list[Generation]) -> list[Collected]:
    async def one(gen: Generation) -> Collected:
        out = Collected()
        texts = []  # joined once: `out.text += ...` would copy the whole text for every delta
        async with aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                out.token_ids += delta.token_ids
                out.logprobs += delta.logprobs
                out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        out.text = "".join(texts)
        return out

    tasks = [asyncio.ensure_future(one(gen)) for gen in gens]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def admitted(gens: list[Generation]) -> None:
    """Before a stream answers 200: wait until the scheduler accepted every generation, so a refusal
    (429 queue full, 400) is still an HTTP status and not an event inside a 200 stream."""
    for gen in gens:
        await gen.admitted()


async def merged_deltas(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every generation as they arrive; raises GenerationError if one fails."""
    if len(gens) == 1:
        async with aclosing(gens[0].deltas()) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async with aclosing(gen.deltas()) as deltas:
                async for delta in deltas:
                    await queue.put((index, delta, None))
        except GenerationError as err:
            await queue.put((index, None, err))
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
