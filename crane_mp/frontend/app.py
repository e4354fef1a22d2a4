"""create_app: the aiohttp application with every route, the error middleware and the body-size limit."""

from __future__ import annotations

import msgspec
from aiohttp import web

import hmac

from crane_mp.frontend import openai_routes, openapi, sglang_routes, tokenize_routes
from crane_mp.frontend.engine_client import EngineDeadError
from crane_mp.frontend.errors import ApiError, error_middleware
from crane_mp.frontend.state import STATE, FrontendState

# Open without a key: liveness probes and load balancers must not need the secret.
_OPEN_PATHS = frozenset({"/health"})

routes = web.RouteTableDef()


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Liveness and readiness: 200 once the whole pipeline is ready, 503 while starting or draining."""
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ok"})
    status = "draining" if state.draining else ("engine_dead" if state.client and state.client.dead else "starting")
    return web.json_response({"status": status}, status=503)


@routes.get("/v1/stats")
async def stats(request: web.Request) -> web.Response:
    """Engine counters from the scheduler: running/waiting sequences, KV blocks, totals, decode rate."""
    state = request.app[STATE]
    state.require_ready()
    try:
        snapshot = await state.client.control("stats", timeout=5.0)
    except (TimeoutError, EngineDeadError) as err:
        raise ApiError(503, f"the engine did not answer: {err or 'timeout'}") from err
    body = msgspec.structs.asdict(snapshot)
    body.pop("token")
    return web.json_response(body)


@web.middleware
async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
    """--api-key: every route but /health needs `Authorization: Bearer <key>` (constant-time compare)."""
    key = request.app[STATE].config.api_key
    if key and request.path not in _OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`")
    return await handler(request)


def create_app(state: FrontendState) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, api_key_middleware], client_max_size=state.config.max_request_bytes
    )
    app[STATE] = state
    app.add_routes(routes)
    app.add_routes(openai_routes.routes)
    app.add_routes(tokenize_routes.routes)
    app.add_routes(openapi.routes)
    app.add_routes(sglang_routes.routes)
    return app
