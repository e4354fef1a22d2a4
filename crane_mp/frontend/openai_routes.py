"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, Callable

import msgspec
from aiohttp import web

from crane_mp.frontend.choices import check_context, collect, merged_deltas, start_choices
from crane_mp.frontend.errors import ApiError, error_body
from crane_mp.frontend.generation import Delta, Generation, GenerationError
from crane_mp.frontend.logprobs_format import chat_logprobs, completion_logprobs
from crane_mp.frontend.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    decode_body,
    prompt_inputs,
    sampling_params,
    stop_strings,
)
from crane_mp.frontend.state import STATE, FrontendState

routes = web.RouteTableDef()
_json = msgspec.json.Encoder()
MAX_LOGPROBS = 20


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def _sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _usage(gens: list[Generation], n: int) -> dict[str, int]:
    prompt = sum(g.prompt_tokens for g in gens[::n])  # each prompt counted once, whatever n is
    completion = sum(g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def check_model(state: FrontendState, model: str | None) -> str:
    if model is not None and model not in (state.model_name, state.config.engine.model_path):
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{state.model_name}`", "model")
    return state.model_name


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
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async with aclosing(merged_deltas(gens)) as deltas:
            async for index, delta in deltas:
                for payload in chunk(index, delta):
                    if continuous:
                        payload["usage"] = _usage(gens, n)
                    await response.write(_sse(payload))
        if include_usage:
            await response.write(_sse({**base, "choices": [], "usage": _usage(gens, n)}))
    except GenerationError as err:
        await response.write(_sse(error_body(503, str(err))))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be between 0 and {MAX_LOGPROBS}", param)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_ready()
    req = decode_body(await request.read(), ChatCompletionRequest)
    model = check_model(state, req.model)
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    _check_logprobs(req.top_logprobs, "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    prompt = state.tokenizer.render_chat(
        chat_messages(req.messages), req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
    )
    input_ids = await state.tokenizer.encode(prompt, add_special_tokens=False)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if requested is not None and requested < 1:
        raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
    max_tokens = check_context(state, len(input_ids), requested, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, state.engine_info.vocab_size, logprobs=logprobs)
    gens = await start_choices(state, [input_ids], req.n, params, stop_strings(req), req.skip_special_tokens)
    chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    token_text = state.tokenizer.token_text

    if req.stream:
        base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}
        started: set[int] = set()

        def chunk(index: int, delta: Delta) -> list[dict]:
            payloads = []
            if index not in started:
                started.add(index)
                payloads.append({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]})
            if delta.text or delta.finish_reason or (req.logprobs and delta.token_ids):
                choice = {"index": index, "delta": {"content": delta.text} if delta.text else {},
                          "logprobs": chat_logprobs(token_text, delta.token_ids, delta.logprobs) if req.logprobs else None,
                          "finish_reason": delta.finish_reason}
                if delta.finish_reason:
                    choice["stop_reason"] = delta.stop_reason
                payloads.append({**base, "choices": [choice]})
            return payloads

        return await stream_response(request, gens, req.n, base, chunk, req.stream_options)

    results = await collect(gens)
    choices = []
    for index, out in enumerate(results):
        choice = {"index": index, "message": {"role": "assistant", "content": out.text},
                  "logprobs": chat_logprobs(token_text, out.token_ids, out.logprobs) if req.logprobs else None,
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    body = {"id": chat_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": _usage(gens, req.n)}
    if req.return_token_ids:
        body["prompt_token_ids"] = input_ids
    return json_response(body)


async def _completion_prompts(state: FrontendState, req: CompletionRequest) -> list[list[int]]:
    vocab = state.engine_info.vocab_size
    prompts = []
    for prompt in prompt_inputs(req.prompt):
        if isinstance(prompt, str):
            prompts.append(await state.tokenizer.encode(prompt))
            continue
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        prompts.append(prompt)  # token ids are used as given: no BOS is added
    if any(not p for p in prompts):
        raise ApiError(400, "a prompt is empty", "prompt")
    return prompts


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_ready()
    req = decode_body(await request.read(), CompletionRequest)
    model = check_model(state, req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported (no fill-in-the-middle for these models)", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of other than n is not supported", "best_of")
    _check_logprobs(req.logprobs, "logprobs")
    prompts = await _completion_prompts(state, req)
    requested = 16 if req.max_tokens is None else req.max_tokens
    if requested == 0 and not req.echo:
        raise ApiError(400, "max_tokens may be 0 only with echo=true", "max_tokens")
    # max_tokens=0 with echo scores the prompt: generate one token internally and show none.
    limits = [check_context(state, len(p), max(requested, 1), "prompt") for p in prompts]
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, min(limits), state.engine_info.vocab_size, req.logprobs, prompt_logprobs)
    gens = await start_choices(
        state, prompts, req.n, params, stop_strings(req), req.skip_special_tokens, discard_output=requested == 0
    )
    cmpl_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": cmpl_id, "object": "text_completion", "created": created, "model": model}
    token_text = state.tokenizer.token_text
    prompt_texts = [state.tokenizer.decode(p, skip_special_tokens=False) if req.echo else "" for p in prompts]

    if req.stream:
        sent_prompt: set[int] = set()
        offsets: dict[int, int] = {}

        def chunk(index: int, delta: Delta) -> list[dict]:
            gen, prompt_index = gens[index], index // req.n
            text, logprobs = delta.text, None
            echo_ids = None
            if req.echo and index not in sent_prompt:
                sent_prompt.add(index)
                text = prompt_texts[prompt_index] + text
                echo_ids = prompts[prompt_index]
            if req.logprobs is not None:
                logprobs = completion_logprobs(
                    token_text, delta.token_ids, delta.logprobs, req.logprobs, offsets.get(index, 0),
                    echo_ids, gen.prompt_logprobs if echo_ids else None,
                )
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
            if not text and not delta.finish_reason and not delta.token_ids:
                return []
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
            if delta.finish_reason:
                choice["stop_reason"] = delta.stop_reason
            return [{**base, "choices": [choice]}]

        return await stream_response(request, gens, req.n, base, chunk, req.stream_options)

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
        choice = {"index": index, "text": prompt_texts[prompt_index] + out.text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = prompts[prompt_index]
        choices.append(choice)
    body = {**base, "choices": choices, "usage": _usage(gens, req.n)}
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


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


@routes.get("/v1/models/{model_id:.+}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_model(state, request.match_info["model_id"])
    return json_response(_model_card(state))
