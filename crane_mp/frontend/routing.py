"""Each HTTP route declared once: method, path, request body type, what the server must be ready for,
whether it starts generations (the load-shedding gate counts those) or is open without an API key,
and its OpenAPI summary and error statuses. The app's router, the gate, the API-key check and
/openapi.json all read these declarations; nothing else lists routes.

A handler declared with a body type is called as `handler(request, body)` once `requires` passed and
the body decoded (a 400 otherwise); without one, as `handler(request)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

from crane_mp.frontend.openai_schemas import decode_body
from crane_mp.frontend.state import STATE, FrontendState

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

    @property
    def operation_id(self) -> str:
        return self.handler.__name__

    def aiohttp_route(self) -> web.RouteDef:
        handler, body, requires = self.handler, self.body, self.requires

        async def handle(request: web.Request) -> web.StreamResponse:
            if requires is not None:
                requires(request.app[STATE])
            if body is None:
                return await handler(request)
            return await handler(request, decode_body(await request.read(), body))

        handle.__name__ = handler.__name__
        if self.method == "get":
            return web.get(self.path, handle)  # and HEAD, as aiohttp's own GET routes answer it
        return web.route(self.method.upper(), self.path, handle)


class RouteTable:
    """A module's routes, declared with the decorator `table.add(...)` (stackable for aliases)."""

    def __init__(self) -> None:
        self.routes: list[Route] = []

    def add(self, method: str, path: str, **facts: Any) -> Callable[[Handler], Handler]:
        def declare(handler: Handler) -> Handler:
            self.routes.append(Route(method, path, handler, **facts))
            return handler

        return declare


def generation_paths(routes: list[Route]) -> frozenset[str]:
    return frozenset(route.path for route in routes if route.generation)


def open_paths(routes: list[Route]) -> frozenset[str]:
    return frozenset(route.path for route in routes if route.open)
