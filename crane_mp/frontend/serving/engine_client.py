"""The frontend's side of the pipeline: submit and abort requests, receive TokenBatches, ask for stats.

One listener task reads the scheduler's output socket and appends tokens to each request's stream;
handlers wait on their stream. A consumer that falls behind finds several tokens waiting and takes
them at once (coalesced), so no per-token queue grows. The scheduler's first, empty output for a
request says it was admitted (streams wait for it before sending a 200). With --request-timeout,
a request still open at its deadline is ended here with an error and aborted in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from crane_mp.frontend.web.errors import EngineDeadError
from crane_mp.frontend.web.metrics import Metrics
from crane_mp.ipc import Addresses, encode, frontend_decoder, make_socket
from crane_mp.protocol import (
    AbortNamed,
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineState,
    EngineStats,
    ErrorKind,
    FinishReason,
    FrontendRestarted,
    GenerateRequest,
    LoraAdapter,
    LoraRegistry,
    MediaInput,
    PromptLogprobs,
    SamplingParams,
    TokenBatch,
    TokenLogprobs,
    TokenOutput,
)

log = logging.getLogger("crane_mp.frontend")

@dataclass(slots=True)
class RequestStream:
    rid: int
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    num_consumed: int = 0
    finish_reason: int | None = None
    stop_token_id: int | None = None
    error: str | None = None
    error_kind: ErrorKind = ErrorKind.INTERNAL  # why, with `error`
    admitted: bool = False  # the scheduler accepted the request (or it already finished)
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time: float | None = None
    cached_tokens: int = 0
    steps: int = 0  # scheduler steps that gave it tokens: fewer than its tokens where steps speculate
    embedding: bytes | None = None  # an embedding request's pooled vector (float32)
    submitted: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    deadline: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, out: TokenOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
            self.steps += 1
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs or [None] * len(out.new_token_ids))
        self.prompt_logprobs.extend(out.prompt_logprobs)
        self.cached_tokens = out.cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        self.admitted = True
        if out.finish_reason is not None:
            self.finish(out.finish_reason, out.error, ErrorKind(out.error_kind))
            self.stop_token_id, self.queue_time = out.stop_token_id, out.queue_time
        self.changed.set()

    def finish(self, reason: int, error: str | None = None, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        self.finish_reason, self.error, self.error_kind = reason, error, kind
        if self.deadline is not None:
            self.deadline.cancel()
        self.changed.set()

    async def wait_admitted(self) -> None:
        """Until the scheduler accepted the request or it ended (a refusal is then in `error`)."""
        while not self.admitted and not self.finished:
            await self.changed.wait()
            self.changed.clear()

    async def next_tokens(self) -> list[int]:
        """Every token that arrived since the last call (at least one, or none once finished)."""
        while self.num_consumed == len(self.token_ids) and not self.finished:
            await self.changed.wait()
            self.changed.clear()
        new = self.token_ids[self.num_consumed :]
        self.num_consumed = len(self.token_ids)
        return new


class EngineClient:
    def __init__(self, addresses: Addresses, frontend_id: int, request_timeout: float = 0.0, life: int = 0) -> None:
        """`life`: how many times the launcher restarted this frontend (0: first start)."""
        self.frontend_id = frontend_id
        self.request_timeout = request_timeout
        self.ctx = zmq.asyncio.Context()
        # Sends go through a plain socket: its queue is unbounded (ipc.make_socket), so a non-blocking
        # send never waits, and skips the asyncio socket's futures (a tenth of a burst's frontend time).
        self.send_ctx = zmq.Context()
        self.to_scheduler = make_socket(self.send_ctx, zmq.PUSH, addresses.scheduler_inbox, bind=False)
        self.from_scheduler = make_socket(self.ctx, zmq.PULL, addresses.frontend_inbox(frontend_id), bind=False)
        self.streams: dict[int, RequestStream] = {}
        self.replies: dict[int, asyncio.Future] = {}
        # Request ids are unique across frontends and their lives: the frontend id sits in the high
        # bits, then the life (a restarted frontend's ids never meet those its last life left running).
        self._rids = itertools.count((frontend_id << 48) + ((life % 256) << 40) + 1)
        # So are control tokens: a reply the last life never read may still arrive on this inbox.
        self._tokens = itertools.count(((life % 256) << 40) + 1)
        if life:
            self.to_scheduler.send(encode(FrontendRestarted(frontend_id)))
        self.dead: str | None = None
        self.metrics: Metrics | None = None  # set by the frontend; finished requests report to it
        self.on_adapters: Callable[[list[LoraAdapter]], None] | None = None  # the LoRA list changed
        self.on_state: Callable[[EngineState], None] | None = None  # the model slept, woke or changed weights
        self._listener: asyncio.Task | None = None

    def start(self) -> None:
        self._listener = asyncio.get_running_loop().create_task(self._listen())
        self._listener.add_done_callback(self._listener_stopped)

    def _listener_stopped(self, task: asyncio.Task) -> None:
        """Nothing reaches this frontend without the listener: fail what waits (503) and turn /health to
        503 rather than let every request hang on a healthy-looking server."""
        if task.cancelled():
            return
        err = task.exception()
        log.error("the engine listener stopped", exc_info=err)
        self.fail_all(f"this frontend stopped hearing from the engine ({type(err).__name__})")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        self.ctx.destroy(linger=0)
        self.send_ctx.destroy(linger=0)

    def new_rid(self) -> int:
        return next(self._rids)

    async def submit(
        self, rid: int, input_ids: list[int], sampling: SamplingParams, names: list[str] | None = None,
        media: list[MediaInput] | None = None,
    ) -> RequestStream:
        if self.dead:
            raise EngineDeadError(self.dead)
        # Encoded before the stream is registered: a value msgpack cannot carry leaves nothing behind.
        message = encode(GenerateRequest(rid, input_ids, sampling, self.frontend_id, time.time(), names or [],
                                         media or []))
        stream = RequestStream(rid, len(input_ids))
        self.streams[rid] = stream
        try:
            self.to_scheduler.send(message, zmq.NOBLOCK)
        except BaseException:
            del self.streams[rid]
            raise
        if self.request_timeout:
            stream.deadline = asyncio.get_running_loop().call_later(self.request_timeout, self._expire, rid)
        return stream

    def _expire(self, rid: int) -> None:
        stream = self.streams.pop(rid, None)
        if stream is None or stream.finished:
            return
        stream.finish(FinishReason.ERROR, f"the request timed out after {self.request_timeout:g} s "
                                          "(--request-timeout)", ErrorKind.TIMEOUT)
        if not self.dead:
            self.to_scheduler.send(encode(AbortRequest(rid)), zmq.NOBLOCK)

    async def abort_named(self, name: str) -> None:
        """Abort every request the client calls `name`, on whichever frontend it runs."""
        if not self.dead:
            self.to_scheduler.send(encode(AbortNamed(name)), zmq.NOBLOCK)

    async def abort(self, rid: int) -> None:
        """Stop a request; its KV blocks come back within a step."""
        self.release(rid)
        if not self.dead:
            self.to_scheduler.send(encode(AbortRequest(rid)), zmq.NOBLOCK)

    def release(self, rid: int) -> None:
        stream = self.streams.pop(rid, None)
        if stream is not None and stream.deadline is not None:
            stream.deadline.cancel()

    async def control(self, kind: str, timeout: float, name: str = "", path: str = "",
                      level: int = 0) -> EngineStats | ControlReply:
        if self.dead:
            raise EngineDeadError(self.dead)
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self.replies[token] = future
        try:
            request = ControlRequest(kind, token, self.frontend_id, name, path, level)
            self.to_scheduler.send(encode(request), zmq.NOBLOCK)
            return await asyncio.wait_for(future, timeout)
        finally:
            self.replies.pop(token, None)

    def fail_all(self, reason: str) -> None:
        """The engine died: end every open stream with an error so no client hangs."""
        self.dead = reason
        for stream in list(self.streams.values()):
            stream.finish(FinishReason.ERROR, reason, ErrorKind.UNAVAILABLE)
        for future in self.replies.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def _listen(self) -> None:
        while True:
            frame = await self.from_scheduler.recv()
            try:
                message = frontend_decoder.decode(frame)
            except msgspec.DecodeError as err:
                log.warning("dropped a malformed message from the scheduler: %s", err)
                continue
            if isinstance(message, TokenBatch):
                for out in message.outputs:
                    stream = self.streams.get(out.rid)
                    if stream is not None:
                        stream.push(out)
                        if out.finish_reason is not None:
                            del self.streams[out.rid]
            elif isinstance(message, LoraRegistry):
                if self.on_adapters is not None:
                    self.on_adapters(message.adapters)
            elif isinstance(message, EngineState):
                if self.on_state is not None:
                    self.on_state(message)
            else:
                future = self.replies.get(message.token)
                if future is not None and not future.done():
                    future.set_result(message)
