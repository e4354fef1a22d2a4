"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from crane_mp.frontend.errors import ApiError, error_body
from crane_mp.frontend.generation import Generation, GenerationError, start_generation
from crane_mp.frontend.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    prompt_inputs,
    sampling_params,
    stop_strings,
)
from crane_mp.frontend.state import STATE, FrontendState

routes = web.RouteTableDef()
_json = msgspec.json.Encoder()


def _sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _usage(gen: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.completion_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
    }


def _usage_chunk(req, base: dict[str, Any], gen: Generation):
    """stream_options.include_usage: a last chunk with empty choices and the usage."""
    if req.stream_options is None or not req.stream_options.include_usage:
        return None
    return lambda: {**base, "choices": [], "usage": _usage(gen)}


def _check_model(state: FrontendState, model: str | None) -> str:
    if model is not None and model not in (state.model_name, state.config.engine.model_path):
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{state.model_name}`", "model")
    return state.model_name


def _max_tokens(state: FrontendState, requested: int | None, num_prompt: int) -> int:
    limit = state.engine_info.max_model_len
    if num_prompt >= limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                            f"{num_prompt} tokens", "messages")
    if requested is None:
        return limit - num_prompt
    if requested < 1:
        raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
    if num_prompt + requested > limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but {num_prompt} prompt "
                            f"tokens + {requested} max_tokens were requested", "max_tokens")
    return requested


async def _start(state: FrontendState, req, input_ids: list[int], max_tokens: int | None) -> Generation:
    if not input_ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    params = sampling_params(req, _max_tokens(state, max_tokens, len(input_ids)), state.engine_info.vocab_size)
    return await start_generation(
        state.client, state.tokenizer.backend, input_ids, params, stop_strings(req), req.skip_special_tokens
    )


async def _stream(request: web.Request, gen: Generation, chunk, usage_chunk) -> web.StreamResponse:
    """SSE: `chunk(delta)` per delta, then the usage chunk if asked, then [DONE]; errors as an SSE event."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for delta in gen.deltas():
            for payload in chunk(delta):
                await response.write(_sse(payload))
        if usage_chunk is not None:
            await response.write(_sse(usage_chunk()))
    except GenerationError as err:
        await response.write(_sse(error_body(503, str(err))))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _collect(gen: Generation) -> tuple[str, str | None, int | str | None]:
    text, finish, stop_reason = [], None, None
    try:
        async for delta in gen.deltas():
            text.append(delta.text)
            finish, stop_reason = delta.finish_reason, delta.stop_reason
    except GenerationError as err:
        raise ApiError(503, str(err)) from err
    return "".join(text), finish, stop_reason


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_ready()
    req = decode_body(await request.read(), ChatCompletionRequest)
    model = _check_model(state, req.model)
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    messages = [msgspec.structs.asdict(m) for m in req.messages]
    messages = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]
    prompt = state.tokenizer.render_chat(
        messages,
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        **(req.chat_template_kwargs or {}),
    )
    input_ids = await state.tokenizer.encode(prompt, add_special_tokens=False)
    gen = await _start(state, req, input_ids, req.max_completion_tokens or req.max_tokens)
    chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if req.stream:
        base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}
        first = [True]

        def chunk(delta):
            payloads = []
            if first[0]:
                first[0] = False
                payloads.append({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]})
            if delta.text or delta.finish_reason:
                content = {"content": delta.text} if delta.text else {}
                payloads.append({**base, "choices": [{"index": 0, "delta": content, "logprobs": None,
                                                      "finish_reason": delta.finish_reason,
                                                      **({"stop_reason": delta.stop_reason} if delta.finish_reason else {})}]})
            return payloads

        return await _stream(request, gen, chunk, _usage_chunk(req, base, gen))

    text, finish, stop_reason = await _collect(gen)
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish, "stop_reason": stop_reason}
    body = {"id": chat_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": _usage(gen)}
    if req.return_token_ids:
        choice["token_ids"] = gen.stream.token_ids[: gen.completion_tokens]
        body["prompt_token_ids"] = input_ids
    return web.json_response(body, dumps=lambda o: _json.encode(o).decode())


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.require_ready()
    req = decode_body(await request.read(), CompletionRequest)
    model = _check_model(state, req.model)
    prompts = prompt_inputs(req.prompt)
    if len(prompts) != 1:
        raise ApiError(400, "several prompts in one request are not supported yet; send one per request", "prompt")
    prompt = prompts[0]
    if isinstance(prompt, str):
        input_ids = await state.tokenizer.encode(prompt)
    else:
        vocab = state.engine_info.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        input_ids = prompt
    gen = await _start(state, req, input_ids, 16 if req.max_tokens is None else req.max_tokens)
    cmpl_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": cmpl_id, "object": "text_completion", "created": created, "model": model}

    if req.stream:
        def chunk(delta):
            if not delta.text and not delta.finish_reason:
                return []
            return [{**base, "choices": [{"index": 0, "text": delta.text, "logprobs": None,
                                          "finish_reason": delta.finish_reason,
                                          **({"stop_reason": delta.stop_reason} if delta.finish_reason else {})}]}]

        return await _stream(request, gen, chunk, _usage_chunk(req, base, gen))

    text, finish, stop_reason = await _collect(gen)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
    body = {**base, "choices": [choice], "usage": _usage(gen)}
    if req.return_token_ids:
        choice["token_ids"] = gen.stream.token_ids[: gen.completion_tokens]
        body["prompt_token_ids"] = input_ids
    return web.json_response(body, dumps=lambda o: _json.encode(o).decode())


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
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


@routes.get("/v1/models/{model_id:.+}")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_model(state, request.match_info["model_id"])
    return web.json_response(_model_card(state))
