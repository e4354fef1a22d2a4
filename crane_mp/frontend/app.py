"""create_app: the aiohttp application with every route and the connection, access-log, error, API-key
and body-size middlewares (outermost first)."""

from __future__ import annotations

import hmac

from aiohttp import web

from crane_mp.frontend import openapi
from crane_mp.frontend.api_routes import ROUTES
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.access_log import add_request_id_header, make_access_middleware
from crane_mp.frontend.web.errors import ApiError, error_middleware
from crane_mp.frontend.web.routing import admin_paths, open_paths, served_routes

# aiohttp's own body limit; bodies above it (up to --max-request-bytes) are read through a clone.
_APP_BODY_LIMIT = 1 << 20


_OPEN_PATHS = open_paths(ROUTES)
_ADMIN_PATHS = admin_paths(ROUTES)


@web.middleware
async def connection_middleware(request: web.Request, handler) -> web.StreamResponse:
    """A request's headers arrived: its connection no longer races the header deadline."""
    request.app[STATE].connections.request_started(request.protocol)
    return await handler(request)


def require_api_key(request: web.Request, config) -> None:
    """--api-key: every route but the open ones (/health) needs `Authorization: Bearer <key>` (or
    `x-api-key: <key>`, as Anthropic's clients send it); the routes that change server state need
    --admin-api-key instead where one is set (constant-time compares). `config`: the ServerConfig
    whose keys apply (the router of several models checks the same rule at its door)."""
    key = config.api_key
    if request.path in _ADMIN_PATHS and config.admin_api_key:
        key = config.admin_api_key
    if key and request.path not in _OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key alone in x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")


@web.middleware
async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
    require_api_key(request, request.app[STATE].config)
    return await handler(request)


@web.middleware
async def body_limit_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Bodies over the limit get 413 before they are read (by their Content-Length) or while they are."""
    limit = request.app[STATE].max_request_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, f"request body of {length} bytes is over the {limit}-byte limit (--max-request-bytes)")
    if length is not None and length <= min(limit, _APP_BODY_LIMIT):
        return await handler(request)  # within both limits as declared: no copy of the request needed
    return await handler(request.clone(client_max_size=limit))


def create_app(state: FrontendState) -> web.Application:
    access = make_access_middleware(state)
    middlewares = [connection_middleware, access, error_middleware, api_key_middleware, body_limit_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=_APP_BODY_LIMIT)
    app[STATE] = state
    app.on_response_prepare.append(add_request_id_header)
    app.add_routes(route.aiohttp_route() for route in [*served_routes(ROUTES, state.config), *openapi.api.routes])
    return app
