"""The public port of a server with several models: every API route of a one-model server, routed by
the request's `model` to that model's own frontend, whose answer streams back unchanged.

The model comes from the JSON body's `model` (a form field for audio uploads; `?model=` on the admin
routes and where a body has none); a request naming none goes to the first model serving the route's
task. An unknown name is a 404 naming it; a model of the wrong task for the route a 400 naming both.
`/v1/models` lists every model with its state, `/health` is 200 once the models loaded at start serve,
and `/metrics` merges every loaded model's series (each labelled with its `model_name`) with the
router's own: model states, loads, evictions, requests waiting for a load, resident bytes.
"""

from __future__ import annotations

import email.parser
import email.policy
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from crane_mp import __version__
from crane_mp.frontend.api_routes import ROUTES
from crane_mp.frontend.app import require_api_key
from crane_mp.frontend.state import FrontendState
from crane_mp.frontend.web.errors import ApiError, error_middleware
from crane_mp.frontend.web.http import json_response
from crane_mp.frontend.web.routing import json_request_error
from crane_mp.router.manager import LoadQueueFull, ModelManager, ModelUnavailable, Slot
from crane_mp.router.metrics import merge_expositions, router_exposition

MANAGER = web.AppKey("manager", ModelManager)

# The tasks whose models serve each route, read from the routes' own declarations.
_TASKS_OF = {FrontendState.require_generative: ("generate",), FrontendState.require_embedding: ("embed",),
             FrontendState.require_scoring: ("score", "generate"),
             FrontendState.require_transcription: ("transcribe",)}
ROUTE_TASKS = {route.path: _TASKS_OF[route.requires] for route in ROUTES if route.requires in _TASKS_OF}
_FORWARDED = frozenset(route.path for route in ROUTES if "{" not in route.path) | {"/openapi.json"}
_STORED_RESPONSES = "/v1/responses/"  # a stored answer: on the model that gave it
# Headers that belong to one connection, not to the message (RFC 9110 7.6.1), and lengths aiohttp sets.
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "content-length", "host"))
_MEDIA_REQUEST_BYTES = 64 << 20


@web.middleware
async def post_type_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The one-model server's rule for every POST (web/routing.py): a JSON body, or a program's bare
    bytes; a web page's cross-origin form never reaches a model, nor the routes the router answers."""
    if request.method == "POST" and request.content_type != "multipart/form-data":
        problem = json_request_error(request)
        if problem is not None:
            raise ApiError(415, problem)
    return await handler(request)


@web.middleware
async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The one-model server's rule: the models behind the router take no key of their own."""
    require_api_key(request, request.app[MANAGER].models.public)
    return await handler(request)


def create_router_app(manager: ModelManager) -> web.Application:
    limit = manager.models.public.max_request_bytes or _MEDIA_REQUEST_BYTES
    app = web.Application(middlewares=[error_middleware, api_key_middleware, post_type_middleware],
                          client_max_size=limit)
    app[MANAGER] = manager
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_get("/metrics", metrics)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_post("/abort_request", abort_request)
    for path in ("/sleep", "/wake_up"):
        app.router.add_post(path, every_model)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


# ---- the router's own routes ----------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    starting = [slot.name for slot in manager.at_start() if slot.state != "loaded"]
    if manager.stopping or starting:
        status = "draining" if manager.stopping else "starting"
        return json_response({"status": status, "loading": starting}, status=503)
    return json_response({"status": "ok"})


async def _sleeping(slot: Slot) -> bool:
    if slot.state != "loaded" or slot.session is None:
        return False
    try:
        async with slot.session.get("http://model/is_sleeping") as response:
            return bool((await response.json()).get("is_sleeping"))
    except (aiohttp.ClientError, ValueError):
        return False


async def _card(slot: Slot) -> dict[str, Any]:
    state = "sleeping" if await _sleeping(slot) else slot.state
    return {
        "id": slot.name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "crane-mp",
        "root": slot.spec.config.engine.model_path,
        "parent": None,
        "max_model_len": slot.info.max_model_len if slot.info else None,
        "state": state,
        "task": slot.task,
        "pinned": slot.spec.pinned,
    }


async def _cards(manager: ModelManager) -> list[dict[str, Any]]:
    cards = []
    for slot in manager.slots.values():
        card = await _card(slot)
        cards.append(card)
        cards += [{**card, "id": name, "root": name, "parent": slot.name} for name in manager.adapters_of(slot)]
    return cards


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": await _cards(request.app[MANAGER])})


async def get_model(request: web.Request) -> web.Response:
    wanted = request.match_info["model_id"]
    for card in await _cards(request.app[MANAGER]):
        if card["id"] == wanted:
            return json_response(card)
    raise ApiError(404, f"The model `{wanted}` does not exist.", "model")


async def metrics(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    texts = []
    for slot in list(manager.slots.values()):
        if slot.state == "loaded" and slot.session is not None:
            try:
                async with slot.session.get("http://model/metrics") as response:
                    texts.append(await response.text())
            except aiohttp.ClientError:
                continue
    body = merge_expositions([router_exposition(manager), *texts])
    return web.Response(body=body.encode(), content_type="text/plain", charset="utf-8")


async def server_info(request: web.Request) -> web.StreamResponse:
    """?model=NAME: that model's own; else the models, their states and the memory they hold."""
    manager = request.app[MANAGER]
    if "model" in request.query:
        slot = manager.slots[pick_model(manager, request.path, request.query["model"])]
        if slot.state != "loaded":  # not loaded to be described
            return json_response({"version": __version__, **await _card(slot)})
        return await forward(request)
    return json_response({
        "version": __version__,
        "memory_budget_bytes": manager.budget,
        "resident_bytes": manager.resident_bytes(),
        "load_on_demand": manager.models.load_on_demand,
        "models": [{**await _card(slot), "footprint_bytes": slot.footprint if slot.state == "loaded" else 0,
                    "estimate_bytes": manager.estimate(slot), "loads": slot.loads, "evictions": slot.evictions,
                    "waiting": slot.waiting, "in_flight": slot.in_flight, "error": slot.error}
                   for slot in manager.slots.values()],
    })


async def every_model(request: web.Request) -> web.StreamResponse:
    """/sleep and /wake_up: ?model=NAME's, else every loaded model's (the first refusal is the answer)."""
    manager = request.app[MANAGER]
    if "model" in request.query:
        name = pick_model(manager, request.path, request.query["model"])
        if request.path == "/sleep" and manager.slots[name].state != "loaded":
            return json_response({"success": True})  # an unloaded model holds nothing: not loaded to sleep
        return await forward(request)
    for slot in list(manager.slots.values()):
        if slot.state != "loaded" or slot.session is None:
            continue
        try:
            async with slot.session.post("http://model" + request.rel_url.raw_path_qs) as response:
                if response.status >= 400:
                    return web.Response(status=response.status, body=await response.read(),
                                        content_type="application/json")
        except aiohttp.ClientConnectionError:
            continue  # evicted or stopped meanwhile: it holds nothing now
    return json_response({"success": True})


async def is_sleeping(request: web.Request) -> web.StreamResponse:
    """?model=NAME's answer, else whether every loaded model sleeps, and each one's state."""
    manager = request.app[MANAGER]
    if "model" in request.query:
        slot = manager.slots[pick_model(manager, request.path, request.query["model"])]
        if slot.state != "loaded":  # not loaded to be asked
            return json_response({"is_sleeping": False, "level": 0, "state": slot.state})
        return await forward(request)
    states = {slot.name: ("sleeping" if await _sleeping(slot) else slot.state) for slot in manager.slots.values()}
    loaded = [state for state in states.values() if state in ("loaded", "sleeping")]
    return json_response({"is_sleeping": bool(loaded) and all(state == "sleeping" for state in loaded),
                          "models": states})


async def abort_request(request: web.Request) -> web.Response:
    """A request id is unique server-wide: every loaded model is told."""
    manager = request.app[MANAGER]
    body = await request.read()
    for slot in list(manager.slots.values()):
        if slot.state == "loaded" and slot.session is not None:
            try:
                async with slot.session.post("http://model/abort_request", data=body,
                                             headers={"Content-Type": "application/json"}) as response:
                    if response.status >= 400:
                        return web.Response(status=response.status, body=await response.read(),
                                            content_type="application/json")
            except aiohttp.ClientError:
                continue
    return json_response({"success": True})


# ---- forwarding -----------------------------------------------------------------------------------


def named_model(request: web.Request, body: bytes) -> str | None:
    """The model a request names: the JSON body's `model`, a form's `model` field, else `?model=`."""
    if body and request.content_type == "multipart/form-data":
        header = f"Content-Type: {request.headers.get('Content-Type', '')}\r\n\r\n".encode()
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(header + body)
        for part in message.iter_parts() if message.is_multipart() else ():
            if part.get_param("name", header="content-disposition") == "model":
                return part.get_content().strip()
    elif body:
        try:
            decoded = msgspec.json.decode(body)
        except msgspec.DecodeError:
            decoded = None
        if isinstance(decoded, dict) and isinstance(decoded.get("model"), str):
            return decoded["model"]
    return request.query.get("model")


def pick_model(manager: ModelManager, path: str, name: str | None) -> str:
    """The served model for `name` (an adapter's base for an adapter's name) on `path`: 404 unknown,
    400 of the wrong task; none named: the first model of the route's task."""
    tasks = ROUTE_TASKS.get(path)
    if name:
        base = manager.model_for(name)
        if base is None:
            raise ApiError(404, f"The model `{name}` does not exist.", "model")
        task = manager.slots[base].task
        if tasks is not None and task not in tasks:
            raise ApiError(400, f"model {name!r} serves --task {task}; {path} needs a model of --task "
                                f"{' or '.join(tasks)}", "model")
        return base
    for slot in manager.slots.values():
        if tasks is None or slot.task in tasks:
            return slot.name
    raise ApiError(400, f"no model of this server serves {path} (--task {' or '.join(tasks or ())})", "model")


async def forward(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    if request.path.startswith(_STORED_RESPONSES):
        return await stored_response(request)
    if request.path not in _FORWARDED:  # never load a model for a path no model serves
        raise ApiError(404, f"route {request.method} {request.path} not found")
    body = await request.read()
    name = pick_model(manager, request.path, named_model(request, body))
    try:
        slot = await manager.acquire(name)
    except LoadQueueFull as err:
        raise ApiError(429, str(err)) from None
    except ModelUnavailable as err:
        raise ApiError(503, str(err)) from None
    try:
        if request.path == "/update_weights_from_disk":
            try:
                await manager.room_for_new_weights(slot)
            except ModelUnavailable as err:
                raise ApiError(409, str(err)) from None
        return await _relay(request, slot, body)
    finally:
        await manager.release(slot)


async def stored_response(request: web.Request) -> web.Response:
    """GET or DELETE /v1/responses/{id}: each loaded model keeps the answers it gave; the first that has it."""
    manager = request.app[MANAGER]
    for slot in list(manager.slots.values()):
        if slot.state != "loaded" or slot.session is None or slot.task != "generate":
            continue
        async with slot.session.request(request.method, "http://model" + request.rel_url.raw_path_qs) as response:
            if response.status != 404:
                return web.Response(status=response.status, body=await response.read(),
                                    content_type=response.content_type)
    raise ApiError(404, f"no stored response {request.path.removeprefix(_STORED_RESPONSES)!r}")


async def _relay(request: web.Request, slot: Slot, body: bytes) -> web.StreamResponse:
    headers = {key: value for key, value in request.headers.items() if key.lower() not in _HOP_BY_HOP}
    response: web.StreamResponse | None = None
    try:
        async with slot.session.request(request.method, "http://model" + request.rel_url.raw_path_qs,
                                        headers=headers, data=body or None, allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    response.headers.add(key, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            if request.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and upstream.status == 200:
                request.app[MANAGER].adapters_changed(slot, request.path, body)
            return response
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
        if response is not None and response.prepared:
            return response  # the model's processes died mid-answer: the client sees the stream end
        raise ApiError(503, f"model {slot.name!r} is not answering: {err}") from None
