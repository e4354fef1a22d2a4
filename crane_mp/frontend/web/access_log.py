"""Per-request bookkeeping around every HTTP request: its id, and one access log line when it ends.

The request id is the client's `X-Request-Id` (sanitised) or a new one; it is returned in the
response header, named in internal errors and accepted by /abort_request. Generations started while
a request is served register with its record (a context variable), so the line can give tokens,
queue time and TTFT without the routes passing anything around. Prompts are logged only with
--log-requests.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from crane_mp.frontend.serving.generation import Generation
from crane_mp.frontend.web.errors import REQUEST_ID

log = logging.getLogger("crane_mp.access")
# Probes and scrapes: logged at debug level only, they would drown everything else.
_QUIET_PATHS = frozenset({"/health", "/metrics"})
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")
_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("access_record", default=None)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    started: float = field(default_factory=time.monotonic)
    generations: list[Generation] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # kept only with --log-requests
    keep_prompts: bool = False
    images: int = 0  # images the request's prompts held
    audio_seconds: float = 0.0  # seconds of audio it transcribed

    def add(self, gen: Generation, input_ids: list[int]) -> None:
        self.generations.append(gen)
        if self.keep_prompts:
            self.prompts.append(input_ids)

    def fields(self, request: web.Request, status: int, model: str, decode) -> dict[str, object]:
        gens = self.generations
        now = time.monotonic()
        firsts = [g.stream.first_token_time for g in gens if g.stream.first_token_time is not None]
        queued = [g.stream.queue_time for g in gens if g.stream.queue_time is not None]
        out: dict[str, object] = {
            "request_id": self.request_id,
            "method": request.method,
            "route": logged_path(request),
            "status": status,
            "model": model if gens else None,
            "prompt_tokens": sum(g.prompt_tokens for g in gens),
            "cached_tokens": sum(g.cached_tokens for g in gens),
            "completion_tokens": sum(g.completion_tokens for g in gens),
            "queue_time": round(max(queued), 4) if queued else None,
            "ttft": round(min(firsts) - self.started, 4) if firsts else None,
            "total_time": round(now - self.started, 4),
            "finish_reason": ",".join(sorted({g.finish_name for g in gens})) or None,
        }
        if self.images:
            out["images"] = self.images
        if self.audio_seconds:
            out["audio_seconds"] = round(self.audio_seconds, 3)
        if self.keep_prompts and self.prompts:
            out["prompt"] = [decode(ids) for ids in self.prompts] if len(self.prompts) > 1 else decode(self.prompts[0])
        return out


def current_record() -> RequestRecord | None:
    return _current.get()


def request_id_of(request: web.Request) -> str:
    header = request.headers.get("X-Request-Id", "")
    return header if _CLIENT_ID.fullmatch(header) else uuid.uuid4().hex


def make_access_middleware(state):
    """The middleware, bound to the frontend's state (its config, metrics and tokenizer)."""
    config = state.config

    @web.middleware
    async def access_middleware(request: web.Request, handler) -> web.StreamResponse:
        """Outermost: the error middleware inside it has turned every error into a response."""
        record = RequestRecord(request_id_of(request), keep_prompts=config.log_requests)
        request[REQUEST_ID] = record.request_id
        token = _current.set(record)
        status = 499  # unless a response comes back: the client went away (the handler was cancelled)
        try:
            response = await handler(request)
            status = response.status
            if status == 429:  # shed by the gate (gate.py), or the scheduler's queue was full
                state.metrics.request_rejected()
            return response
        except web.HTTPException as err:
            status = err.status
            raise
        finally:
            _current.reset(token)
            _log(request, record, status, state)

    return access_middleware


def _log(request: web.Request, record: RequestRecord, status: int, state) -> None:
    level = logging.DEBUG if request.path in _QUIET_PATHS else logging.INFO
    if not state.config.access_log or not log.isEnabledFor(level):
        return
    decode = state.tokenizer.backend.decode if record.keep_prompts else None
    fields = record.fields(request, status, state.model_name, decode)
    log.log(level, "%s %s %d", request.method, logged_path(request), status, extra={"fields": fields})


def logged_path(request: web.Request) -> str:
    """The path as the client sent it, still percent-encoded: a decoded %0a would start a forged line."""
    return request.rel_url.raw_path


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response, streamed or not, error or not, carries the request id."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id


class MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a NUL in a header, a malformed request line) as an error
    with a traceback, after answering it 400: a client could fill the log with them. One debug line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and record.levelno >= logging.ERROR:
            log.debug("refused a malformed HTTP request: %s", str(error).splitlines()[0] if str(error) else "")
            return False
        return True
