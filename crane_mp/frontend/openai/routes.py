"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from crane_mp.frontend.openai.bodies import ChatStream, CompletionStream, chat_choice, completion_choice, usage
from crane_mp.frontend.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    chat_messages,
    image_urls,
    prompt_inputs,
    sampling_params,
    stop_strings,
    tool_dicts,
    video_urls,
)
from crane_mp.frontend.serving.answers import read_whole
from crane_mp.frontend.serving.chat_core import ChatAsk, prepare_chat
from crane_mp.frontend.serving.choices import Collected
from crane_mp.frontend.serving.generation import Delta, Generation
from crane_mp.frontend.serving.logprobs_format import chat_logprobs, completion_logprobs
from crane_mp.frontend.serving.pipeline import Plan, prompt_ids, serve
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.http import check_model, json_response, resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable

api = RouteTable()
# OpenAI's default output budget for /v1/completions (chat's default is all the room left).
COMPLETION_MAX_TOKENS = 16


@dataclass(slots=True)
class OpenAIStream:
    """A streamed OpenAI response: the API's chunks per delta (with usage in each when
    stream_options.continuous_usage_stats), and a usage chunk at the end when include_usage."""

    gens: list[Generation]
    n: int
    base: dict[str, Any]
    chunk: Callable[[int, Delta], list[dict]]
    options: StreamOptions | None
    reasoning_tokens: Callable[[], int] | None = None  # where answers are read for thinking

    def chunks(self, index: int, delta: Delta) -> list[dict]:
        payloads = self.chunk(index, delta)
        if self.options is not None and self.options.continuous_usage_stats:
            for payload in payloads:
                payload["usage"] = self._usage()
        return payloads

    def closing(self) -> list[dict]:
        if self.options is not None and self.options.include_usage:
            return [{**self.base, "choices": [], "usage": self._usage()}]
        return []

    def _usage(self) -> dict[str, Any]:
        return usage(self.gens, self.n, self.reasoning_tokens() if self.reasoning_tokens else None)


@api.add("post", "/v1/chat/completions", body=ChatCompletionRequest, requires=FrontendState.require_generative,
         generation=True, errors=GENERATION_ERRORS, summary="Chat completion (SSE when stream=true)")
async def chat_completions(request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse:
    state = request.app[STATE]
    model, lora_id = await resolve_model(state, req.model)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    ask = ChatAsk(
        chat_messages(req.messages), sampling_params(req, state.engine_info.vocab_size, logprobs=logprobs,
                                                     lora_id=lora_id),
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, chat_id,
        tool_dicts(req.tools), req.tool_choice, req.parallel_tool_calls, req.constraint(), stop_strings(req.stop),
        req.template_kwargs(), req.add_generation_prompt, req.continue_final_message, req.separate_reasoning,
        req.thinking_budget if req.thinking_budget is not None else req.max_thinking_tokens, req.n,
        req.skip_special_tokens, image_urls(req.messages), req.mm_processor_kwargs, video_urls(req.messages),
    )
    chat = await prepare_chat(state, ask)
    reading, thinking = chat.tools, chat.thinking
    created = int(time.time())
    token_text = state.tokenizer.token_text

    def render(gens: list[Generation]):
        if req.stream:
            base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}
            stream = ChatStream(base, reading, token_text if req.logprobs else None, thinking)
            counted = (lambda: stream.reasoning_tokens) if thinking else None
            return OpenAIStream(gens, req.n, base, stream.chunks, req.stream_options, counted)

        def body(results: list[Collected]) -> dict[str, Any]:
            choices, thought = [], 0
            for index, out in enumerate(results):
                answer = read_whole(out.text, out.token_ids, reading, thinking, out.finish_reason)
                thought += answer.reasoning_tokens
                choices.append(chat_choice(
                    index, answer, out.finish_reason, out.stop_reason, reading is not None,
                    chat_logprobs(token_text, out.token_ids, out.logprobs) if req.logprobs else None,
                    out.token_ids if req.return_token_ids else None))
            out = {"id": chat_id, "object": "chat.completion", "created": created, "model": model,
                   "choices": choices, "usage": usage(gens, req.n, thought if thinking else None)}
            if req.return_token_ids:
                out["prompt_token_ids"] = chat.input_ids
            return out

        return body

    return await serve(request, state, chat.plan, render)


@api.add("post", "/v1/completions", body=CompletionRequest, requires=FrontendState.require_generative,
         generation=True, errors=GENERATION_ERRORS, summary="Text completion (SSE when stream=true)")
async def completions(request: web.Request, req: CompletionRequest) -> web.StreamResponse:
    state = request.app[STATE]
    model, lora_id = await resolve_model(state, req.model)
    prompts = [await prompt_ids(state, prompt, "prompt") for prompt in prompt_inputs(req.prompt, state.engine_info.vocab_size)]
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, state.engine_info.vocab_size, req.logprobs, prompt_logprobs, lora_id)
    params = await state.grammars.constrain(params, req.constraint(), state.engine_info)
    cmpl_id = f"cmpl-{uuid.uuid4().hex}"
    requested = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    plan = Plan(prompts, params, requested, "prompt", req.n, stop_strings(req.stop), req.skip_special_tokens,
                names=cmpl_id)
    base = {"id": cmpl_id, "object": "text_completion", "created": int(time.time()), "model": model}
    token_text = state.tokenizer.token_text
    prompt_texts = [state.tokenizer.decode(p, skip_special_tokens=False) if req.echo else "" for p in prompts]

    def render(gens: list[Generation]):
        if req.stream:
            stream = CompletionStream(base, req.n, prompt_texts, prompts if req.echo else None, req.logprobs,
                                      token_text, lambda index: gens[index].prompt_logprobs)
            return OpenAIStream(gens, req.n, base, stream.chunks, req.stream_options)

        def body(results: list[Collected]) -> dict[str, Any]:
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
            response = {**base, "choices": choices, "usage": usage(gens, req.n)}
            if req.return_token_ids and len(prompts) == 1:
                response["prompt_token_ids"] = prompts[0]
            return response

        return body

    return await serve(request, state, plan, render)


def _model_card(state: FrontendState) -> dict[str, Any]:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "crane-mp",
        "root": state.config.engine.model_path,
        "parent": None,
        "max_model_len": state.engine_info.max_model_len if state.engine_info else None,
        "state": state.model_state if state.engine_info else "loading",
    }


def _adapter_card(state: FrontendState, name: str) -> dict[str, Any]:
    """Its root is its name: where adapters lie on the server's disk stays in the server's log."""
    return {**_model_card(state), "id": name, "root": name, "parent": state.model_name}


def _model_cards(state: FrontendState) -> dict[str, dict[str, Any]]:
    cards = {state.model_name: _model_card(state)}
    cards.update((name, _adapter_card(state, name)) for name in state.adapters)
    return cards


@api.add("get", "/v1/models", summary="List the served model and its LoRA adapters")
async def list_models(request: web.Request) -> web.Response:
    """The served model, then each LoRA adapter (its `parent` the base model), as vLLM lists them."""
    state = request.app[STATE]
    await state.catch_up()  # its state: asleep or not
    return json_response({"object": "list", "data": list(_model_cards(state).values())})


@api.add("get", "/v1/models/{model_id:.+}", errors=("404",), summary="Describe the served model")
async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.catch_up()
    return json_response(_model_cards(state)[await check_model(state, request.match_info["model_id"])])
