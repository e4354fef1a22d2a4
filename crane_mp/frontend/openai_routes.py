"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, Callable

from aiohttp import web

from crane_mp.frontend.choices import admitted, collect, merged_deltas, open_choices, resolve_max_tokens
from crane_mp.frontend.errors import ApiError, error_body
from crane_mp.frontend.generation import Delta, Generation, GenerationError
from crane_mp.frontend.http import SSE_DONE, SSE_HEADERS, check_model, json_response, resolve_model, sse_event
from crane_mp.frontend.logprobs_format import chat_logprobs, completion_logprobs
from crane_mp.frontend.openai_responses import (
    ChatStream,
    CompletionStream,
    ToolReading,
    chat_choice,
    completion_choice,
    usage,
)
from crane_mp.frontend.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    decode_body,
    prompt_inputs,
    sampling_params,
    stop_strings,
    tool_dicts,
)
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.tool_calls import check_tools, forced_call_constraint, tool_format, tool_prompt

routes = web.RouteTableDef()


async def stream_response(
    request: web.Request,
    gens: list[Generation],
    n: int,
    base: dict[str, Any],
    chunk: Callable[[int, Delta], list[dict]],
    stream_options,
) -> web.StreamResponse:
    """SSE: chunks per delta, the usage chunk if asked, then [DONE]; an engine failure is an SSE error event."""
    include_usage = stream_options is not None and stream_options.include_usage
    continuous = stream_options is not None and stream_options.continuous_usage_stats
    await admitted(gens)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async with aclosing(merged_deltas(gens)) as deltas:
            async for index, delta in deltas:
                for payload in chunk(index, delta):
                    if continuous:
                        payload["usage"] = usage(gens, n)
                    await response.write(sse_event(payload))
        if include_usage:
            await response.write(sse_event({**base, "choices": [], "usage": usage(gens, n)}))
    except GenerationError as err:
        await response.write(sse_event(error_body(err.status, str(err))))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_generative()
    req = decode_body(await request.read(), ChatCompletionRequest)
    model, lora_id = resolve_model(state, req.model)
    tools = tool_dicts(req.tools)
    fmt = tool_format(state.config.tool_call_parser, state.engine_info.arch, state.tokenizer.marker_tokens)
    mode, only = check_tools(tools, req.tool_choice, fmt)
    prompt = state.tokenizer.render_chat(
        chat_messages(req.messages), req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
        tools, tool_prompt(fmt, tools) if tools and fmt else None,
    )
    limit = state.engine_info.max_model_len
    input_ids = await state.tokenizer.encode(prompt, limit - 1, "messages", add_special_tokens=False)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(state, len(input_ids), requested, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, state.engine_info.vocab_size, logprobs=logprobs, lora_id=lora_id)
    constraint = req.constraint()
    if mode in ("required", "named"):
        if constraint is not None:
            raise ApiError(400, f"tool_choice {mode} already constrains the output; drop {constraint.param}",
                           constraint.param)
        constraint = forced_call_constraint(fmt, tools, only, req.parallel_tool_calls,
                                            state.tokenizer.marker_tokens)
    params = await state.grammars.constrain(params, constraint, state.engine_info)
    reading = ToolReading(fmt, req.parallel_tool_calls) if mode != "none" else None
    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    async with open_choices(state, [input_ids], req.n, params, [max_tokens], stop_strings(req.stop),
                            req.skip_special_tokens, names=chat_id) as gens:
        return await _chat_response(request, req, model, input_ids, gens, chat_id, reading)


async def _chat_response(request, req: ChatCompletionRequest, model: str, input_ids: list[int],
                         gens: list[Generation], chat_id: str, tools: ToolReading | None) -> web.StreamResponse:
    created = int(time.time())
    token_text = request.app[STATE].tokenizer.token_text
    if req.stream:
        base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}
        stream = ChatStream(base, tools, token_text if req.logprobs else None)
        return await stream_response(request, gens, req.n, base, stream.chunks, req.stream_options)

    results = await collect(gens)
    choices = [chat_choice(index, out.text, out.finish_reason, out.stop_reason, tools,
                           chat_logprobs(token_text, out.token_ids, out.logprobs) if req.logprobs else None,
                           out.token_ids if req.return_token_ids else None)
               for index, out in enumerate(results)]
    body = {"id": chat_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(gens, req.n)}
    if req.return_token_ids:
        body["prompt_token_ids"] = input_ids
    return json_response(body)


async def _completion_prompts(state: FrontendState, req: CompletionRequest) -> list[list[int]]:
    limit = state.engine_info.max_model_len
    prompts = []
    for prompt in prompt_inputs(req.prompt, state.engine_info.vocab_size):
        # Token ids are used as given: no BOS is added.
        prompts.append(await state.tokenizer.encode(prompt, limit - 1, "prompt") if isinstance(prompt, str) else prompt)
    return prompts


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_generative()
    req = decode_body(await request.read(), CompletionRequest)
    model, lora_id = resolve_model(state, req.model)
    prompts = await _completion_prompts(state, req)
    requested = 16 if req.max_tokens is None else req.max_tokens
    # max_tokens=0 shows no output (with echo: the prompt, scored); the engine still makes one token.
    max_tokens = [resolve_max_tokens(state, len(p), max(requested, 1), "prompt") for p in prompts]
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, state.engine_info.vocab_size, req.logprobs, prompt_logprobs, lora_id)
    params = await state.grammars.constrain(params, req.constraint(), state.engine_info)
    cmpl_id = f"cmpl-{uuid.uuid4().hex}"
    async with open_choices(state, prompts, req.n, params, max_tokens, stop_strings(req.stop),
                            req.skip_special_tokens, discard_output=requested == 0, names=cmpl_id) as gens:
        return await _completion_response(request, req, model, prompts, gens, cmpl_id)


async def _completion_response(request, req: CompletionRequest, model: str, prompts: list[list[int]],
                               gens: list[Generation], cmpl_id: str) -> web.StreamResponse:
    state = request.app[STATE]
    base = {"id": cmpl_id, "object": "text_completion", "created": int(time.time()), "model": model}
    token_text = state.tokenizer.token_text
    prompt_texts = [state.tokenizer.decode(p, skip_special_tokens=False) if req.echo else "" for p in prompts]

    if req.stream:
        stream = CompletionStream(base, req.n, prompt_texts, prompts if req.echo else None, req.logprobs, token_text,
                                  lambda index: gens[index].prompt_logprobs)
        return await stream_response(request, gens, req.n, base, stream.chunks, req.stream_options)

    results = await collect(gens)
    choices = []
    for index, out in enumerate(results):
        prompt_index = index // req.n
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(
                token_text, out.token_ids, out.logprobs, req.logprobs, 0,
                prompts[prompt_index] if req.echo else None, gens[index].prompt_logprobs,
            )
        choices.append(completion_choice(
            index, prompt_texts[prompt_index] + out.text, logprobs, out.finish_reason, out.stop_reason,
            out.token_ids if req.return_token_ids else None, prompts[prompt_index],
        ))
    body = {**base, "choices": choices, "usage": usage(gens, req.n)}
    if req.return_token_ids and len(prompts) == 1:
        body["prompt_token_ids"] = prompts[0]
    return json_response(body)


def _model_card(state: FrontendState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "crane-mp",
        "root": state.config.engine.model_path,
        "parent": None,
        "max_model_len": state.engine_info.max_model_len if state.engine_info else None,
    }


def _adapter_card(state: FrontendState, name: str, path: str) -> dict[str, Any]:
    return {**_model_card(state), "id": name, "root": path, "parent": state.model_name}


def _model_cards(state: FrontendState) -> dict[str, dict[str, Any]]:
    cards = {state.model_name: _model_card(state)}
    cards.update((name, _adapter_card(state, name, adapter.path)) for name, adapter in state.adapters.items())
    return cards


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    """The served model, then each LoRA adapter (its `parent` the base model), as vLLM lists them."""
    return json_response({"object": "list", "data": list(_model_cards(request.app[STATE]).values())})


@routes.get("/v1/models/{model_id:.+}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(_model_cards(state)[check_model(state, request.match_info["model_id"])])
