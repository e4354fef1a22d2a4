"""/v1/responses: the OpenAI Responses API over the chat pipeline (chat_core.py), with stored responses
for previous_response_id (store.py), and GET and DELETE of a stored one."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from crane_mp.frontend.openai.schemas import effort_kwargs, function_tool
from crane_mp.frontend.responses.answers import ResponseDraft, ResponsesStream, output_items, text_logprobs, usage
from crane_mp.frontend.responses.schemas import ResponsesRequest, input_image_url, input_messages
from crane_mp.frontend.responses.store import new_response_id
from crane_mp.frontend.serving.answers import read_whole
from crane_mp.frontend.serving.chat_core import ChatAsk, named_tool, prepare_chat
from crane_mp.frontend.serving.choices import Collected
from crane_mp.frontend.serving.generation import Generation
from crane_mp.frontend.serving.message_parts import ImageParts, stored_images
from crane_mp.frontend.serving.pipeline import serve
from crane_mp.frontend.serving.structured import Constraint
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.http import json_response, resolve_model
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable
from crane_mp.protocol import SamplingParams

api = RouteTable()


@api.add("post", "/v1/responses", body=ResponsesRequest, requires=FrontendState.require_generative,
         generation=True, errors=GENERATION_ERRORS, summary="OpenAI Responses API (SSE events when stream=true)")
async def create_response(request: web.Request, req: ResponsesRequest) -> web.StreamResponse:
    state = request.app[STATE]
    model, lora_id = await resolve_model(state, req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        record = state.responses.get(req.previous_response_id) if state.responses else None
        if record is None:
            raise ApiError(404, f"previous response {req.previous_response_id!r} not found (responses are kept "
                                "until the server restarts, the newest 1,024 at most)", "previous_response_id")
        history = record["messages"]
    images = ImageParts(("input_image",), input_image_url)
    conversation = [*history, *input_messages(req.input, images)]
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    tools = [function_tool(t.name, t.description, t.parameters, t.strict) for t in req.tools or []] or None
    choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None \
        else named_tool(req.tool_choice.name)
    response_id = new_response_id()
    params = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, logprobs=req.logprobs, lora_id=lora_id)
    token_text = state.tokenizer.token_text if req.logprobs is not None else None
    ask = ChatAsk([*system, *conversation], params, req.max_output_tokens, response_id, tools, choice,
                  req.parallel_tool_calls, _constraint(req),
                  chat_template_kwargs=effort_kwargs(req.reasoning.effort if req.reasoning else None, None),
                  images=stored_images(history, "previous_response_id's input") + images.found)
    chat = await prepare_chat(state, ask)
    echoed = {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": params.temperature, "top_p": params.top_p, "top_logprobs": req.top_logprobs,
        "text": {"format": _format_echo(req)}, "tool_choice": _choice_echo(req),
        "tools": [{"type": "function", **tool["function"]} for tool in tools or []], "truncation": "disabled",
        "metadata": req.metadata or {}, "user": req.user,
    }
    draft = ResponseDraft(response_id, model, echoed, conversation, state.responses)

    def render(gens: list[Generation]):
        if req.stream:
            return ResponsesStream(draft, gens, chat.tools, chat.thinking, token_text)

        def body(results: list[Collected]) -> dict[str, Any]:
            out = results[0]
            answer = read_whole(out.text, out.token_ids, chat.tools, chat.thinking, out.finish_reason)
            logprobs = text_logprobs(token_text, out.token_ids, out.logprobs, answer.reasoning_tokens)
            gen = gens[0]
            return draft.finish(output_items(answer, logprobs), out.finish_reason, usage(
                gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens, answer.reasoning_tokens))

        return body

    return await serve(request, state, chat.plan, render)


@api.add("get", "/v1/responses/{response_id}", requires=FrontendState.require_ready, errors=("404",),
         summary="A stored response")
async def get_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    record = state.responses.get(request.match_info["response_id"]) if state.responses else None
    if record is None:
        raise ApiError(404, f"response {request.match_info['response_id']!r} not found")
    return json_response(record["response"])


@api.add("delete", "/v1/responses/{response_id}", requires=FrontendState.require_ready, errors=("404",),
         summary="Delete a stored response")
async def delete_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    if state.responses is None or not state.responses.delete(response_id):
        raise ApiError(404, f"response {response_id!r} not found")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _constraint(req: ResponsesRequest) -> Constraint | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", "", "text.format")
    return Constraint.json_schema(fmt.schema if fmt.schema is not None else {"type": "object"}, "text.format.schema")


def _format_echo(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return {key: value for key, value in (("type", fmt.type), ("name", fmt.name), ("description", fmt.description),
                                          ("schema", fmt.schema), ("strict", fmt.strict)) if value is not None}


def _choice_echo(req: ResponsesRequest) -> str | dict[str, str]:
    if req.tool_choice is None:
        return "auto"
    if isinstance(req.tool_choice, str):
        return req.tool_choice
    return {"type": "function", "name": req.tool_choice.name}
