"""Every error the frontend answers: OpenAI's shape {"error": {"message", "type", "param", "code"}} (on
Anthropic's Messages routes, its {"type": "error", "error": {"type", "message"}}), and the one map
from why a request failed (protocol.ErrorKind) to its HTTP status."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from aiohttp import web

from crane_mp.protocol import ErrorKind

log = logging.getLogger("crane_mp.frontend")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
REQUEST_ID = web.RequestKey("request_id", str)  # set by the access middleware
# Seconds a client refused with 429 should wait before retrying (queues drain within seconds).
RETRY_AFTER_SECONDS = 1


_KIND_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.INTERNAL: 500,
    ErrorKind.TIMEOUT: 408,
    ErrorKind.UNAVAILABLE: 503,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class GenerationError(ApiError):
    """A request the engine ended with an error: its status follows from why (`kind`)."""

    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(_KIND_STATUS.get(kind, 500), message)
        self.kind = kind


class EngineDeadError(RuntimeError):
    """The scheduler or worker is gone; nothing more will arrive."""


@contextmanager
def engine_answer() -> Iterator[None]:
    """Around a control request to the engine: no answer in time, or no engine, is a 503."""
    try:
        yield
    except (TimeoutError, EngineDeadError) as err:
        raise ApiError(503, f"the engine did not answer: {err or 'timeout'}") from err


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": status}}


# Anthropic's error types by HTTP status (its SDK raises by status; clients show the type).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"  # and below it


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str, param: str | None = None, path: str = "") -> web.Response:
    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(status, message, param)
    response = web.json_response(body, status=status)
    if status == 429:
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err.status, err.message, err.param, request.path)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        if err.status == 404:
            message = f"route {request.method} {request.path} not found"
        elif err.status == 413:
            message = "request body too large (the limit is set by --max-request-bytes)"
        else:
            message = err.reason
        response = error_response(err.status, message, path=request.path)
        if "Allow" in err.headers:  # 405: the methods the route does take (RFC 9110)
            response.headers["Allow"] = err.headers["Allow"]
        return response
    except Exception:
        request_id = request.get(REQUEST_ID, "")
        log.exception("unhandled error in %s %s (request id %s)", request.method, request.rel_url.raw_path, request_id)
        return error_response(500, f"internal server error (request id {request_id})", path=request.path)
