"""GET /openapi.json: an OpenAPI 3.1 document built from the same msgspec Structs that validate requests.

It states exactly what the server accepts: the Structs' own constraints, the served model's limits
(fields.fill_model_limits), and the rules a Struct cannot carry (which prompt shapes, exactly one
of two fields) from the constants next to the code that enforces them.
"""

from __future__ import annotations

import copy

import msgspec
from aiohttp import web

from crane_mp import __version__
from crane_mp.frontend.fields import exactly_one_of, fill_model_limits
from crane_mp.frontend.management_routes import OPEN_PATHS
from crane_mp.frontend.http import json_response
from crane_mp.frontend.openai_schemas import (
    EMBEDDING_INPUT_SCHEMA,
    PROMPT_SCHEMA,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from crane_mp.frontend.lora_routes import LoadLoraRequest, UnloadLoraRequest
from crane_mp.frontend.sglang_schemas import INPUT_IDS_SCHEMA, AbortBody, SGLangGenerateRequest
from crane_mp.frontend.state import STATE
from crane_mp.frontend.tokenize_routes import DetokenizeRequest, TokenizeRequest

routes = web.RouteTableDef()

_GENERATION = ("400", "404", "413", "503")
# (method, path, request body type or None, summary, error statuses besides 401 (--api-key))
OPERATIONS = [
    ("post", "/v1/chat/completions", ChatCompletionRequest, "Chat completion (SSE when stream=true)", _GENERATION),
    ("post", "/v1/completions", CompletionRequest, "Text completion (SSE when stream=true)", _GENERATION),
    ("post", "/v1/embeddings", EmbeddingRequest, "Embeddings (servers started with --task embed)", _GENERATION),
    ("post", "/v1/load_lora_adapter", LoadLoraRequest, "Load a LoRA adapter (--enable-lora)", _GENERATION),
    ("post", "/v1/unload_lora_adapter", UnloadLoraRequest, "Unload a LoRA adapter (--enable-lora)", _GENERATION),
    ("get", "/v1/models", None, "List the served model and its LoRA adapters", ()),
    ("get", "/v1/models/{model_id}", None, "Describe the served model", ("404",)),
    ("post", "/v1/tokenize", TokenizeRequest, "Text or chat messages to token ids", _GENERATION),
    ("post", "/v1/detokenize", DetokenizeRequest, "Token ids to text", ("400", "404", "413")),
    ("get", "/v1/stats", None, "Engine counters", ("503",)),
    ("get", "/health", None, "Liveness and readiness", ("503",)),
    ("post", "/generate", SGLangGenerateRequest, "SGLang native generation (SSE when stream=true)", _GENERATION),
    ("post", "/abort_request", AbortBody, "Abort a /generate request by its rid", ("400", "413")),
    ("get", "/model_info", None, "Model metadata", ()),
    ("get", "/server_info", None, "Server arguments and live engine stats", ("503",)),
    ("get", "/health_generate", None, "Deep health check: one generated token", ("503",)),
    ("post", "/flush_cache", None, "Drop cached prefixes", ()),
    ("get", "/metrics", None, "Prometheus metrics", ()),
]
# Rules a Struct cannot carry: (component, property or None for the whole body) -> schema to merge in.
_REFINEMENTS = {
    ("CompletionRequest", "prompt"): PROMPT_SCHEMA,
    ("EmbeddingRequest", "input"): EMBEDDING_INPUT_SCHEMA,
    ("SGLangGenerateRequest", "input_ids"): {"anyOf": [INPUT_IDS_SCHEMA, {"type": "null"}], "default": None},
    ("SGLangGenerateRequest", None): exactly_one_of("text", "input_ids"),
    ("TokenizeRequest", None): exactly_one_of("prompt", "text", "messages"),
}
_ERROR = {"description": "Error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "null"]}}}},
}


def _components() -> tuple[dict, dict]:
    bodies = [op[2] for op in OPERATIONS if op[2] is not None]
    refs, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    for (name, prop), refinement in _REFINEMENTS.items():
        target = components[name] if prop is None else components[name]["properties"][prop]
        if prop is not None:
            target.clear()
        target.update(copy.deepcopy(refinement))
    components["Error"] = _ERROR_SCHEMA
    return dict(zip(bodies, refs)), components


def build_openapi(vocab_size: int | None = None, max_model_len: int | None = None, model_name: str = "",
                  hidden_size: int = 0) -> dict:
    """The document; with the served model's vocabulary, context window and width once they are known."""
    ref_of, components = _components()
    if vocab_size is not None and max_model_len is not None:
        fill_model_limits(components, vocab_size, max_model_len, hidden_size)
    paths: dict = {}
    for method, path, body, summary, errors in OPERATIONS:
        auth = {} if path in OPEN_PATHS else {"401": _ERROR}
        responses = {"200": {"description": "OK"}, **auth, **{status: _ERROR for status in errors}}
        operation = {"summary": summary, "responses": responses}
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref_of[body]}}}
        if "{model_id}" in path:
            operation["parameters"] = [{"name": "model_id", "in": "path", "required": True,
                                        "schema": {"type": "string"}, "example": model_name}]
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0", "info": {"title": "crane-mp", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.engine_info
    if info is None:
        return json_response(build_openapi(model_name=state.model_name))
    return json_response(build_openapi(info.vocab_size, info.max_model_len, state.model_name, info.hidden_size))
