"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger("crane_mp.frontend")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
REQUEST_ID = web.RequestKey("request_id", str)  # set by the access middleware
# Seconds a client refused with 429 should wait before retrying (queues drain within seconds).
RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    response = web.json_response(error_body(status, message, param), status=status)
    if status == 429:
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err.status, err.message, err.param)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        if err.status == 404:
            message = f"route {request.method} {request.path} not found"
        elif err.status == 413:
            message = "request body too large (the limit is set by --max-request-bytes)"
        else:
            message = err.reason
        response = error_response(err.status, message)
        if "Allow" in err.headers:  # 405: the methods the route does take (RFC 9110)
            response.headers["Allow"] = err.headers["Allow"]
        return response
    except Exception:
        request_id = request.get(REQUEST_ID, "")
        log.exception("unhandled error in %s %s (request id %s)", request.method, request.path, request_id)
        return error_response(500, f"internal server error (request id {request_id})")
