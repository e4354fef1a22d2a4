"""vLLM's run-time LoRA routes: /v1/load_lora_adapter and /v1/unload_lora_adapter (servers started with
--enable-lora or --lora-modules). The scheduler keeps the list and tells every frontend; the worker
loads an adapter between two steps, so requests in flight go on."""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from crane_mp.frontend.engine_client import EngineDeadError
from crane_mp.frontend.errors import ApiError
from crane_mp.frontend.openai_schemas import decode_body
from crane_mp.frontend.state import STATE, FrontendState

routes = web.RouteTableDef()

AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^\s/]+$")]
# Reading and checking an adapter takes a moment; a very large one on a slow disk, longer.
_LOAD_TIMEOUT = 300.0


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: AdapterName
    lora_path: Annotated[str, msgspec.Meta(min_length=1)]


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: AdapterName
    lora_int_id: int | None = None  # vLLM's; adapters are named here


def _require_lora(state: FrontendState) -> None:
    state.require_ready()
    if not state.config.engine.lora:
        raise ApiError(400, "this server was started without LoRA support: add --enable-lora (or --lora-modules)")


async def _change(state: FrontendState, kind: str, name: str, path: str = "") -> None:
    try:
        reply = await state.client.control(kind, _LOAD_TIMEOUT, name, path)
    except (TimeoutError, EngineDeadError) as err:
        raise ApiError(503, f"the engine did not answer: {err or 'timeout'}") from err
    if not reply.ok:
        raise ApiError(reply.status or 400, reply.message, "lora_name" if reply.status != 400 else None)


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_lora(state)
    body = decode_body(await request.read(), LoadLoraRequest)
    if body.lora_name in (state.model_name, state.config.engine.model_path):
        raise ApiError(400, f"{body.lora_name!r} is the base model's name; choose another", "lora_name")
    await _change(state, "load_lora", body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_lora(state)
    body = decode_body(await request.read(), UnloadLoraRequest)
    await _change(state, "unload_lora", body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
