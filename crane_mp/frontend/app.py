"""create_app: the aiohttp application with every route, the error, API-key and body-size middlewares."""

from __future__ import annotations

import hmac

from aiohttp import web

from crane_mp.frontend import management_routes, openai_routes, openapi, sglang_routes, tokenize_routes
from crane_mp.frontend.errors import ApiError, error_middleware
from crane_mp.frontend.management_routes import OPEN_PATHS
from crane_mp.frontend.state import STATE, FrontendState



@web.middleware
async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
    """--api-key: every route but /health needs `Authorization: Bearer <key>` (constant-time compare)."""
    key = request.app[STATE].config.api_key
    if key and request.path not in OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`")
    return await handler(request)


@web.middleware
async def body_limit_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Bodies over the limit get 413 before they are read (by their Content-Length) or while they are."""
    limit = request.app[STATE].max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body of {request.content_length} bytes is over the {limit}-byte limit "
                            "(--max-request-bytes)")
    return await handler(request.clone(client_max_size=limit))


def create_app(state: FrontendState) -> web.Application:
    app = web.Application(middlewares=[error_middleware, api_key_middleware, body_limit_middleware])
    app[STATE] = state
    app.add_routes(management_routes.routes)
    app.add_routes(openai_routes.routes)
    app.add_routes(tokenize_routes.routes)
    app.add_routes(openapi.routes)
    app.add_routes(sglang_routes.routes)
    return app
