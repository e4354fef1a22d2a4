"""GET /openapi.json: an OpenAPI 3.1 document built from the same msgspec Structs that validate requests."""

from __future__ import annotations

import msgspec
from aiohttp import web

from crane_mp import __version__
from crane_mp.frontend.openai_routes import json_response
from crane_mp.frontend.openai_schemas import ChatCompletionRequest, CompletionRequest
from crane_mp.frontend.sglang_routes import AbortBody, GenerateRequest
from crane_mp.frontend.tokenize_routes import DetokenizeRequest, TokenizeRequest

routes = web.RouteTableDef()

# (method, path, request body type or None, summary)
OPERATIONS = [
    ("post", "/v1/chat/completions", ChatCompletionRequest, "Chat completion (SSE when stream=true)"),
    ("post", "/v1/completions", CompletionRequest, "Text completion (SSE when stream=true)"),
    ("get", "/v1/models", None, "List the served model"),
    ("get", "/v1/models/{model_id}", None, "Describe the served model"),
    ("post", "/v1/tokenize", TokenizeRequest, "Text or chat messages to token ids"),
    ("post", "/v1/detokenize", DetokenizeRequest, "Token ids to text"),
    ("get", "/v1/stats", None, "Engine counters"),
    ("get", "/health", None, "Liveness and readiness"),
    ("post", "/generate", GenerateRequest, "SGLang native generation (SSE when stream=true)"),
    ("post", "/abort_request", AbortBody, "Abort a /generate request by its rid"),
    ("get", "/model_info", None, "Model metadata"),
    ("get", "/server_info", None, "Server arguments and live engine stats"),
    ("get", "/health_generate", None, "Deep health check: one generated token"),
    ("post", "/flush_cache", None, "Drop cached prefixes"),
    ("get", "/metrics", None, "Prometheus metrics"),
]

_ERROR = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def build_openapi() -> dict:
    bodies = [op[2] for op in OPERATIONS if op[2] is not None]
    refs, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    components["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "null"]}}}},
    }
    ref_of = dict(zip(bodies, refs))
    paths: dict = {}
    for method, path, body, summary in OPERATIONS:
        operation = {"summary": summary, "responses": {"200": {"description": "OK"}, "400": _ERROR, "503": _ERROR}}
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref_of[body]}}}
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0", "info": {"title": "crane-mp", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return json_response(build_openapi())
