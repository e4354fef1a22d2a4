"""create_app: the aiohttp application with every route, the error middleware and the body-size limit."""

from __future__ import annotations

import msgspec
from aiohttp import web

from crane_mp.frontend import openai_routes
from crane_mp.frontend.engine_client import EngineDeadError
from crane_mp.frontend.errors import ApiError, error_middleware
from crane_mp.frontend.state import STATE, FrontendState

MAX_BODY_BYTES = 32 << 20

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


def create_app(state: FrontendState) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.add_routes(routes)
    app.add_routes(openai_routes.routes)
    return app
