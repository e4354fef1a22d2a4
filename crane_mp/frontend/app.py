"""create_app: the aiohttp application with every route and the access-log, error, API-key and
body-size middlewares (outermost first)."""

from __future__ import annotations

import hmac

from aiohttp import web

from crane_mp.frontend import (
    embedding_routes,
    lora_routes,
    management_routes,
    openai_routes,
    openapi,
    sglang_routes,
    tokenize_routes,
)
from crane_mp.frontend.access_log import add_request_id_header, make_access_middleware
from crane_mp.frontend.errors import ApiError, error_middleware
from crane_mp.frontend.management_routes import OPEN_PATHS
from crane_mp.frontend.state import STATE, FrontendState


# aiohttp's own body limit; bodies above it (up to --max-request-bytes) are read through a clone.
_APP_BODY_LIMIT = 1 << 20


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
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, f"request body of {length} bytes is over the {limit}-byte limit (--max-request-bytes)")
    if length is not None and length <= min(limit, _APP_BODY_LIMIT):
        return await handler(request)  # within both limits as declared: no copy of the request needed
    return await handler(request.clone(client_max_size=limit))


def create_app(state: FrontendState) -> web.Application:
    middlewares = [make_access_middleware(state), error_middleware, api_key_middleware, body_limit_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=_APP_BODY_LIMIT)
    app[STATE] = state
    app.on_response_prepare.append(add_request_id_header)
    app.add_routes(management_routes.routes)
    app.add_routes(openai_routes.routes)
    app.add_routes(embedding_routes.routes)
    app.add_routes(lora_routes.routes)
    app.add_routes(tokenize_routes.routes)
    app.add_routes(openapi.routes)
    app.add_routes(sglang_routes.routes)
    return app
