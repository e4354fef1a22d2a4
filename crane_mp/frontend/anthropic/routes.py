"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat pipeline
(chat_core.py). Errors on these paths take Anthropic's shape (errors.py)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from crane_mp.frontend.anthropic.answers import (
    MessageDraft,
    MessagesStream,
    content_blocks,
    new_message_id,
    stop_reason,
    usage,
)
from crane_mp.frontend.anthropic.schemas import (
    CountTokensRequest,
    MessagesFields,
    MessagesRequest,
    chat_messages,
    image_source_url,
)
from crane_mp.frontend.openai.schemas import function_tool
from crane_mp.frontend.serving.answers import read_whole
from crane_mp.frontend.serving.chat_core import ChatAsk, named_tool, prepare_chat, prompt_with_images
from crane_mp.frontend.serving.choices import Collected
from crane_mp.frontend.serving.generation import Generation
from crane_mp.frontend.serving.message_parts import ImageParts
from crane_mp.frontend.serving.pipeline import serve
from crane_mp.frontend.serving.structured import Constraint
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.http import json_response, resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable
from crane_mp.protocol import SamplingParams

api = RouteTable()
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _ask(req: MessagesFields, params: SamplingParams, max_tokens: int | None, name: str) -> ChatAsk:
    tools = [function_tool(t.name, t.description, t.input_schema) for t in req.tools or []] or None
    choice, parallel = None, True
    if req.tool_choice is not None:
        parallel = not req.tool_choice.disable_parallel_tool_use
        if req.tool_choice.type == "tool":
            if not req.tool_choice.name:
                raise ApiError(400, "tool_choice of type tool needs a name", "tool_choice")
            choice = named_tool(req.tool_choice.name)
        else:
            choice = _CHOICES[req.tool_choice.type]
    template, budget = None, None
    if req.thinking is not None and req.thinking.type == "disabled":
        template = {"enable_thinking": False}
    elif req.thinking is not None and req.thinking.type == "enabled":
        template, budget = {"enable_thinking": True}, req.thinking.budget_tokens
    constraint = None
    if req.output_config is not None and req.output_config.format is not None:
        constraint = Constraint.json_schema(req.output_config.format.schema, "output_config.format.schema")
    images = ImageParts(("image",), image_source_url)
    return ChatAsk(chat_messages(req, images), params, max_tokens, name, tools, choice, parallel, constraint,
                   chat_template_kwargs=template, thinking_budget=budget, images=images.found)


@api.add("post", "/v1/messages", body=MessagesRequest, requires=FrontendState.require_generative,
         generation=True, errors=GENERATION_ERRORS, summary="Anthropic Messages API (SSE events when stream=true)")
async def create_message(request: web.Request, req: MessagesRequest) -> web.StreamResponse:
    state = request.app[STATE]
    model, lora_id = await resolve_model(state, req.model)
    params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p,
                            top_k=0 if req.top_k is None else req.top_k, lora_id=lora_id)
    message_id = new_message_id()
    ask = _ask(req, params, req.max_tokens, message_id)
    ask.stop = [s for s in req.stop_sequences or [] if s]
    chat = await prepare_chat(state, ask)
    draft = MessageDraft(message_id, model)

    def render(gens: list[Generation]):
        if req.stream:
            return MessagesStream(draft, gens, chat.tools, chat.thinking)

        def body(results: list[Collected]) -> dict[str, Any]:
            out = results[0]
            answer = read_whole(out.text, out.token_ids, chat.tools, chat.thinking, out.finish_reason)
            reason = stop_reason(out.finish_reason, out.stop_reason, bool(answer.calls))
            return draft.message(content_blocks(answer), reason, usage(gens[0]))

        return body

    return await serve(request, state, chat.plan, render)


@api.add("post", "/v1/messages/count_tokens", body=CountTokensRequest, requires=FrontendState.require_generative,
         errors=GENERATION_ERRORS, summary="Anthropic Messages API: the prompt's token count")
async def count_tokens(request: web.Request, req: CountTokensRequest) -> web.Response:
    state = request.app[STATE]
    await resolve_model(state, req.model)
    _, input_ids, _ = await prompt_with_images(state, _ask(req, SamplingParams(), None, ""))
    return json_response({"input_tokens": len(input_ids)})
