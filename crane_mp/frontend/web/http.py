"""HTTP helpers every route module shares: JSON bodies, SSE events and headers, the model check."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.web.errors import ApiError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def sse_event(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def named_sse_event(payload: dict[str, Any]) -> bytes:
    """An event named by its payload's type (the Responses and Anthropic streams)."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


async def resolve_model(state: FrontendState, model: str | None) -> tuple[str, int]:
    """(the model name to answer with, its LoRA adapter id: 0 for the base model). A request naming
    neither the served model nor one of its adapters is a 404 in OpenAI's shape, once this frontend has
    caught up with the scheduler (an adapter just loaded through another frontend is known here then)."""
    if model is None or model in (state.model_name, state.config.engine.model_path):
        return state.model_name, 0
    adapter = state.adapters.get(model)
    if adapter is None:
        await state.catch_up()
        adapter = state.adapters.get(model)
    if adapter is None:
        served = ", ".join(f"`{name}`" for name in (state.model_name, *state.adapters))
        raise ApiError(404, f"the model `{model}` does not exist; this server serves {served}", "model")
    return model, adapter.lora_id


async def check_model(state: FrontendState, model: str | None) -> str:
    return (await resolve_model(state, model))[0]
