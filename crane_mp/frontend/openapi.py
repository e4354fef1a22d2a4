"""GET /openapi.json: an OpenAPI 3.1 document built from the same msgspec Structs that validate requests.

It states exactly what the server accepts: the Structs' own constraints, the served model's limits
(fields.fill_model_limits), and the rules a Struct cannot carry (which prompt shapes, exactly one
of two fields) from the constants next to the code that enforces them.
"""

from __future__ import annotations

import copy
import re

import msgspec
from aiohttp import web

from crane_mp import __version__
from crane_mp.frontend.anthropic.schemas import (
    MESSAGES_SCHEMA as ANTHROPIC_MESSAGES_SCHEMA,
    SYSTEM_SCHEMA as ANTHROPIC_SYSTEM_SCHEMA,
)
from crane_mp.frontend.api_routes import ROUTES
from crane_mp.frontend.openai.schemas import EMBEDDING_INPUT_SCHEMA, PROMPT_SCHEMA
from crane_mp.frontend.responses.schemas import INPUT_SCHEMA as RESPONSES_INPUT_SCHEMA
from crane_mp.frontend.sglang.schemas import INPUT_IDS_SCHEMA
from crane_mp.frontend.state import STATE
from crane_mp.frontend.web.fields import exactly_one_of, fill_model_limits
from crane_mp.frontend.web.http import json_response
from crane_mp.frontend.web.routing import Route, RouteTable, served_routes

api = RouteTable()

# Rules a Struct cannot carry: (component, property or None for the whole body) -> schema to merge in.
_REFINEMENTS = {
    ("CompletionRequest", "prompt"): PROMPT_SCHEMA,
    ("EmbeddingRequest", "input"): EMBEDDING_INPUT_SCHEMA,
    ("ResponsesRequest", "input"): RESPONSES_INPUT_SCHEMA,
    ("MessagesRequest", "messages"): ANTHROPIC_MESSAGES_SCHEMA,
    ("MessagesRequest", "system"): ANTHROPIC_SYSTEM_SCHEMA,
    ("CountTokensRequest", "messages"): ANTHROPIC_MESSAGES_SCHEMA,
    ("CountTokensRequest", "system"): ANTHROPIC_SYSTEM_SCHEMA,
    ("SGLangGenerateRequest", "input_ids"): {"anyOf": [INPUT_IDS_SCHEMA, {"type": "null"}], "default": None},
    # Exactly one input; and prompt logprobs are not copied n times (pipeline._check_size), here and below.
    ("SGLangGenerateRequest", None): {**exactly_one_of("text", "input_ids"), "not": {
        "required": ["return_logprob", "logprob_start_len", "sampling_params"],
        "properties": {"return_logprob": {"const": True}, "logprob_start_len": {"type": "integer", "minimum": 0},
                       "sampling_params": {"type": "object", "required": ["n"],
                                           "properties": {"n": {"type": "integer", "minimum": 2}}}}}},
    ("CompletionRequest", None): {"not": {
        "required": ["echo", "logprobs", "n"],
        "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"},
                       "n": {"type": "integer", "minimum": 2}}}},
    ("TokenizeRequest", None): exactly_one_of("prompt", "text", "messages"),
}
_ERROR = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "null"]}}}},
}


def _documented(routes: list[Route]) -> list[Route]:
    """Routes with a summary; aliases (an old name, a second method) have none."""
    return [route for route in routes if route.summary]


def _components(routes: list[Route]) -> tuple[dict, dict]:
    bodies = list(dict.fromkeys(route.body or route.form for route in routes if route.body or route.form))
    refs, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    for (name, prop), refinement in _REFINEMENTS.items():
        target = components[name] if prop is None else components[name]["properties"][prop]
        if prop is not None:
            target.clear()
        target.update(copy.deepcopy(refinement))
    components["Error"] = _ERROR_SCHEMA
    return dict(zip(bodies, refs)), components


def build_openapi(vocab_size: int | None = None, max_model_len: int | None = None, model_name: str = "",
                  hidden_size: int = 0, config=None) -> dict:
    """The document (of the routes `config`'s server mounts; every route without one); with the served
    model's vocabulary, context window and width once they are known."""
    routes = _documented(ROUTES if config is None else served_routes(ROUTES, config))
    ref_of, components = _components(routes)
    if vocab_size is not None and max_model_len is not None:
        fill_model_limits(components, vocab_size, max_model_len, hidden_size)
    paths: dict = {}
    for route in routes:
        auth = {} if route.open else {"401": _ERROR}
        responses = {"200": {"description": "OK"}, **auth, **{status: _ERROR for status in route.errors}}
        operation = {"summary": route.summary, "operationId": route.operation_id, "responses": responses}
        if route.body is not None:
            schema = ref_of[route.body]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        elif route.form is not None:
            operation["requestBody"] = {"required": True, "content": {"multipart/form-data": {
                "schema": ref_of[route.form]}}}
        path = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", route.path)  # aiohttp's {name:regex} -> OpenAPI's {name}
        if "{model_id}" in path:
            operation["parameters"] = [{"name": "model_id", "in": "path", "required": True,
                                        "schema": {"type": "string"}, "example": model_name}]
        paths.setdefault(path, {})[route.method] = operation
    return {"openapi": "3.1.0", "info": {"title": "crane-mp", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}


@api.add("get", "/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.engine_info
    if info is None:
        return json_response(build_openapi(model_name=state.model_name, config=state.config))
    return json_response(build_openapi(info.vocab_size, info.max_model_len, state.model_name, info.hidden_size,
                                       state.config))
