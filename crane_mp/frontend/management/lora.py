"""vLLM's run-time LoRA routes: /v1/load_lora_adapter and /v1/unload_lora_adapter, mounted only on a
server started with --enable-runtime-lora (404 elsewhere, as vLLM without
VLLM_ALLOW_RUNTIME_LORA_UPDATING) and guarded by the admin key. An adapter loads only from under
--lora-root. The scheduler keeps the list and tells every frontend; the worker reads the adapter beside
its step loop, so requests in flight go on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from aiohttp import web

from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError, engine_answer
from crane_mp.frontend.web.routing import GENERATION_ERRORS, RouteTable

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


def _runtime_lora(config) -> bool:
    return config.engine.runtime_lora


def _under_lora_root(state: FrontendState, lora_path: str) -> str:
    """`lora_path` resolved (relative to --lora-root, symlinks followed); it must stay inside the root."""
    root = Path(state.config.engine.lora_root).resolve()
    resolved = (root / lora_path).resolve()
    if not resolved.is_relative_to(root):
        raise ApiError(400, "lora_path must lie under the server's --lora-root", "lora_path")
    return str(resolved)


async def _change(state: FrontendState, kind: str, name: str, path: str = "") -> None:
    with engine_answer():
        reply = await state.client.control(kind, _LOAD_TIMEOUT, name, path)
    if not reply.ok:
        raise ApiError(reply.status or 400, reply.message, "lora_name" if reply.status != 400 else None)


@api.add("post", "/v1/load_lora_adapter", body=LoadLoraRequest, requires=FrontendState.require_ready,
         errors=GENERATION_ERRORS, admin=True, mounted=_runtime_lora,
         summary="Load a LoRA adapter (--enable-runtime-lora)")
async def load_lora_adapter(request: web.Request, body: LoadLoraRequest) -> web.Response:
    state = request.app[STATE]
    if body.lora_name in (state.model_name, state.config.engine.model_path):
        raise ApiError(400, f"{body.lora_name!r} is the base model's name; choose another", "lora_name")
    await _change(state, "load_lora", body.lora_name, _under_lora_root(state, body.lora_path))
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@api.add("post", "/v1/unload_lora_adapter", body=UnloadLoraRequest, requires=FrontendState.require_ready,
         errors=GENERATION_ERRORS, admin=True, mounted=_runtime_lora,
         summary="Unload a LoRA adapter (--enable-runtime-lora)")
async def unload_lora_adapter(request: web.Request, body: UnloadLoraRequest) -> web.Response:
    await _change(request.app[STATE], "unload_lora", body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
