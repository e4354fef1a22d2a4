"""Each HTTP route declared once: method, path, request body type, what the server must be ready for,
whether it starts generations (the load-shedding gate counts those) or is open without an API key,
and its OpenAPI summary and error statuses. The app's router, the gate, the API-key check and
/openapi.json all read these declarations; nothing else lists routes.

A handler declared with a body type is called as `handler(request, body)` once `requires` passed and
the body decoded (a 400 otherwise); without one, as `handler(request)`. Every POST must be a JSON
request (json_request_error): what a web page can send another origin without a CORS preflight (a
form, text/plain, a body of no type) is refused with 415 before the body is read. The exception is a
route declared with `form` (a file upload, as OpenAI's audio routes take it): multipart/form-data,
decoded into that Struct (uploads.py), and refused from a browser (an Origin header) for the same reason.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import hdrs, web

from crane_mp.frontend.openai.schemas import decode_body
from crane_mp.frontend.state import STATE, FrontendState
from crane_mp.frontend.web.errors import ApiError
from crane_mp.frontend.web.uploads import read_form

# Error statuses a route that reads a body and reaches the engine can answer (besides 401, --api-key).
GENERATION_ERRORS = ("400", "404", "413", "503")

Handler = Callable[..., Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str = ""  # empty: an alias, left out of /openapi.json
    body: type | None = None
    errors: tuple[str, ...] = ()
    requires: Callable[[FrontendState], None] | None = None  # e.g. FrontendState.require_ready
    generation: bool = False  # starts generations: counted by the load-shedding gate
    open: bool = False  # served without the API key (probes)
    admin: bool = False  # changes server state: needs the admin key (--admin-api-key, else --api-key)
    mounted: Callable[[Any], bool] | None = None  # served only where this holds for the ServerConfig
    form: type | None = None  # a multipart/form-data body decoded into this Struct (instead of `body`)

    @property
    def operation_id(self) -> str:
        return self.handler.__name__

    def aiohttp_route(self) -> web.RouteDef:
        handler, body, requires, post = self.handler, self.body, self.requires, self.method == "post"
        generation, form = self.generation, self.form

        async def handle(request: web.Request) -> web.StreamResponse:
            problem = form_request_error(request) if form is not None else json_request_error(request) if post else None
            if problem is not None:
                raise ApiError(415, problem)
            state = request.app[STATE]
            if requires is not None:
                requires(state)
            if body is None and form is None:
                return await handler(request)
            if form is not None:
                decoded = await read_form(request, form, state.config.read_timeout, state.max_request_bytes)
            else:
                decoded = decode_body(await read_body(request, state.config.read_timeout), body)
            if not generation:
                return await handler(request, decoded)
            async with state.gate.admit():
                return await handler(request, decoded)

        handle.__name__ = handler.__name__
        if self.method == "get":
            return web.get(self.path, handle)  # and HEAD, as aiohttp's own GET routes answer it
        return web.route(self.method.upper(), self.path, handle)


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body within `timeout` seconds: a client that trickles it holds no handler for long."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--read-timeout)") from None


def json_request_error(request: web.Request) -> str | None:
    """Why a POST is not a JSON request, or None. The body's declared type must be application/json
    (vLLM's and SGLang's rule). A request that declares none passes unless a browser sent it (it
    carries an Origin header): scripts and SDKs that post bare bytes keep working, while a web page's
    cross-origin POST, which can only be preflight-free without a JSON type, never reaches a handler."""
    declared = request.headers.get(hdrs.CONTENT_TYPE)
    if declared is None:
        if hdrs.ORIGIN in request.headers:
            return "a browser's request must declare Content-Type: application/json"
        return None
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        return f"unsupported media type {media_type or declared!r}: only application/json bodies are accepted"
    return None


def form_request_error(request: web.Request) -> str | None:
    """Why an upload is not one: its type must be multipart/form-data, and a browser (Origin) may not
    send one, which it could to another origin without a preflight."""
    if hdrs.ORIGIN in request.headers:
        return "a browser may not post a form to this server; send the upload from a client program"
    declared = request.headers.get(hdrs.CONTENT_TYPE, "")
    if declared.split(";", 1)[0].strip().lower() != "multipart/form-data":
        return f"unsupported media type {declared or 'none'!r}: this route takes multipart/form-data"
    return None


class RouteTable:
    """A module's routes, declared with the decorator `table.add(...)` (stackable for aliases)."""

    def __init__(self) -> None:
        self.routes: list[Route] = []

    def add(self, method: str, path: str, **facts: Any) -> Callable[[Handler], Handler]:
        def declare(handler: Handler) -> Handler:
            self.routes.append(Route(method, path, handler, **facts))
            return handler

        return declare


def served_routes(routes: list[Route], config) -> list[Route]:
    """The routes this server mounts: a route that is not mounted answers 404, as on a server without it."""
    return [route for route in routes if route.mounted is None or route.mounted(config)]


def open_paths(routes: list[Route]) -> frozenset[str]:
    return frozenset(route.path for route in routes if route.open)


def admin_paths(routes: list[Route]) -> frozenset[str]:
    return frozenset(route.path for route in routes if route.admin)
