"""vLLM's run-time LoRA routes: /v1/load_lora_adapter and /v1/unload_lora_adapter (servers started with
--enable-lora or --lora-modules). The scheduler keeps the list and tells every frontend; the worker
loads an adapter between two steps, so requests in flight go on."""

from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from crane_mp.frontend.errors import ApiError, engine_answer
from crane_mp.frontend.routing import GENERATION_ERRORS, RouteTable
from crane_mp.frontend.state import STATE, FrontendState

api = RouteTable()

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
    with engine_answer():
        reply = await state.client.control(kind, _LOAD_TIMEOUT, name, path)
    if not reply.ok:
        raise ApiError(reply.status or 400, reply.message, "lora_name" if reply.status != 400 else None)


@api.add("post", "/v1/load_lora_adapter", body=LoadLoraRequest, requires=_require_lora, errors=GENERATION_ERRORS,
         summary="Load a LoRA adapter (--enable-lora)")
async def load_lora_adapter(request: web.Request, body: LoadLoraRequest) -> web.Response:
    state = request.app[STATE]
    if body.lora_name in (state.model_name, state.config.engine.model_path):
        raise ApiError(400, f"{body.lora_name!r} is the base model's name; choose another", "lora_name")
    await _change(state, "load_lora", body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@api.add("post", "/v1/unload_lora_adapter", body=UnloadLoraRequest, requires=_require_lora,
         errors=GENERATION_ERRORS, summary="Unload a LoRA adapter (--enable-lora)")
async def unload_lora_adapter(request: web.Request, body: UnloadLoraRequest) -> web.Response:
    await _change(request.app[STATE], "unload_lora", body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
