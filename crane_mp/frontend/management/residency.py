"""Sleep, wake-up and new weights: vLLM's /sleep, /wake_up and /is_sleeping, SGLang's
/update_weights_from_disk. All change what the server holds, so they need the admin key.

A sleeping model answers its next request after waking (the scheduler wakes it); new weights are read
while the old ones serve, then swapped in once the requests the old weights started have finished
(scheduler/residency.py). Weights load only from under --weights-root (default: the directory holding
the served model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from aiohttp import web

from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError, engine_answer
from crane_mp.frontend.web.http import json_response
from crane_mp.frontend.web.routing import RouteTable

api = RouteTable()

# Freeing or restoring memory is quick; a deep sleep's wake-up reads the checkpoint again.
_WAKE_TIMEOUT = 600.0
# Reading new weights, then the old weights' requests finishing: bounded by the longest generation.
_RELOAD_TIMEOUT = 3600.0


class UpdateWeightsRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model_path: Annotated[str, msgspec.Meta(min_length=1)]
    load_format: str | None = None  # SGLang's; the format is read from the path, as at start


def _single_rank(state: FrontendState) -> None:
    state.require_ready()
    if state.engine_info.tensor_parallel_size > 1:
        raise ApiError(400, "sleep and new weights serve one worker rank; this server runs "
                            f"--tensor-parallel-size {state.engine_info.tensor_parallel_size}")


def weights_root(state: FrontendState) -> Path:
    """--weights-root, else the directory holding the served model (a GGUF file's, or the checkpoint's parent)."""
    if state.config.weights_root:
        return Path(state.config.weights_root).resolve()
    return Path(state.config.engine.model_path).resolve().parent


def _under_weights_root(state: FrontendState, model_path: str) -> str:
    root = weights_root(state)
    try:
        resolved = (root / model_path).resolve()
    except (OSError, ValueError) as err:  # a NUL byte, a name too long for the file system
        raise ApiError(400, f"model_path is not a usable path: {err}", "model_path") from None
    if not resolved.is_relative_to(root):
        raise ApiError(400, f"model_path must lie under the server's weights root {root} (--weights-root)",
                       "model_path")
    try:
        exists = resolved.exists()
    except OSError as err:
        raise ApiError(400, f"model_path is not a usable path: {err}", "model_path") from None
    if not exists:
        raise ApiError(400, f"model_path {model_path!r} does not exist", "model_path")
    return str(resolved)


def _level(request: web.Request) -> int:
    text = request.query.get("level", "1")
    if text not in ("1", "2"):
        raise ApiError(400, "level must be 1 (free the KV cache) or 2 (free the weights too)", "level")
    return int(text)


@api.add("post", "/sleep", requires=_single_rank, errors=("400", "409", "503"), admin=True,
         summary="Free the model's memory until its next request (vLLM's sleep mode)")
async def sleep(request: web.Request) -> web.Response:
    """?level=1 frees the KV cache (on a GPU the weights also move to host memory); level=2 frees the
    weights too. Refused with 409 while requests are queued or running."""
    state = request.app[STATE]
    level = _level(request)
    with engine_answer():
        reply = await state.client.control("sleep", _WAKE_TIMEOUT, level=level)
    if not reply.ok:
        raise ApiError(reply.status or 400, reply.message)
    return json_response({"success": True, "level": level})


@api.add("post", "/wake_up", requires=_single_rank, errors=("503",), admin=True,
         summary="Make a sleeping model resident again")
async def wake_up(request: web.Request) -> web.Response:
    with engine_answer():
        await request.app[STATE].client.control("wake_up", _WAKE_TIMEOUT)
    return json_response({"success": True})


@api.add("get", "/is_sleeping", requires=FrontendState.require_ready, errors=("503",),
         summary="Whether the model sleeps, and how deeply")
async def is_sleeping(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.catch_up()
    return json_response({"is_sleeping": state.sleep_level > 0, "level": state.sleep_level})


@api.add("post", "/update_weights_from_disk", body=UpdateWeightsRequest, requires=_single_rank,
         errors=("400", "409", "503"), admin=True, summary="Serve new weights of the same model (SGLang's shape)")
async def update_weights_from_disk(request: web.Request, body: UpdateWeightsRequest) -> web.Response:
    """Reads the weights at model_path while the old ones serve; the requests running now finish on the
    old weights, new ones wait for the swap. A failed load answers 400 and leaves the old weights serving."""
    state = request.app[STATE]
    path = _under_weights_root(state, body.model_path)
    with engine_answer():
        reply = await state.client.control("update_weights", _RELOAD_TIMEOUT, path=path)
    if not reply.ok:
        return json_response({"success": False, "message": reply.message, "num_paused_requests": 0},
                             status=reply.status or 400)
    return json_response({"success": True, "message": f"Succeeded to update model weights from {path}.",
                          "num_paused_requests": 0})
