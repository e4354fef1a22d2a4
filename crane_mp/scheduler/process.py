"""Scheduler process: one loop — drain inbox, schedule, send plan, receive result, update, emit tokens.

With overlap (the default) two steps may be in flight: step N+1 is planned and sent while the worker
runs step N, so the worker never waits for the scheduler. Requests are admitted, aborted and
answered between plans; a request that can never run is answered at once with an error.
"""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing.connection import Connection

import zmq

from crane_mp.ipc import Addresses, encode, make_socket, scheduler_decoder
from crane_mp.protocol import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    GenerateRequest,
    ShutdownWorker,
    StepResult,
    TokenBatch,
    TokenOutput,
)
from crane_mp.scheduler.request import FinishReason, Request
from crane_mp.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from crane_mp.scheduler.stats import EngineCounters

log = logging.getLogger("crane_mp.scheduler")


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, addresses: Addresses, num_frontends: int, overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.max_in_flight = 2 if overlap else 1
        self.ctx = zmq.Context()
        self.inbox = make_socket(self.ctx, zmq.PULL, addresses.scheduler_inbox, bind=True)
        self.to_worker = make_socket(self.ctx, zmq.PUSH, addresses.worker_inbox, bind=True)
        self.to_frontends = [
            make_socket(self.ctx, zmq.PUSH, addresses.frontend_inbox(i), bind=True) for i in range(num_frontends)
        ]
        self.counters = EngineCounters()
        self.frontend_of: dict[int, int] = {}  # rid -> frontend id
        self.steps_in_flight = 0
        self.step_started = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        stalled = False
        while True:
            # Plan ahead only once a stream has produced tokens: the steps before that are long
            # prefills, and a plan made at once would miss the rest of a burst still arriving.
            limit = self.max_in_flight if self.scheduler.is_streaming else 1
            # Wait while a step runs or nothing is queued (bounded, so signals are handled promptly);
            # otherwise only drain what has already arrived and plan the next step.
            can_plan = self.scheduler.has_work and self.steps_in_flight < limit and not stalled
            timeout = 0 if can_plan else 1000
            if poller.poll(timeout):
                stalled = False
                while True:
                    try:
                        frame = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(scheduler_decoder.decode(frame))
            if self.steps_in_flight < limit and not stalled:
                plan = self.scheduler.schedule()
                # Nothing to plan until a message arrives (e.g. every request awaits its last token):
                # block on the inbox instead of spinning, the worker needs the cores.
                stalled = plan is None
                if plan is not None:
                    self.to_worker.send(encode(plan))
                    if not self.steps_in_flight:
                        self.step_started = time.monotonic()
                    self.steps_in_flight += 1
                elif not self.scheduler.running and not self.steps_in_flight:
                    self.scheduler.check_invariants()

    def handle(self, message) -> None:
        if isinstance(message, StepResult):
            self.steps_in_flight -= 1
            outputs = self.scheduler.update(message)
            now = time.monotonic()
            self.counters.on_step(outputs, now - self.step_started)
            self.step_started = now  # the next step in flight started when this one ended
            self.emit(outputs)
        elif isinstance(message, GenerateRequest):
            self.admit(message)
        elif isinstance(message, AbortRequest):
            out = self.scheduler.abort_request(message.rid)
            if out is not None:
                self.emit([out])
        elif isinstance(message, ControlRequest):
            self.control(message)

    def admit(self, message: GenerateRequest) -> None:
        req = Request(message.rid, message.input_ids, message.sampling, arrival_time=message.arrival_time)
        try:
            self.scheduler.add_request(req)
        except RequestRejected as err:
            output = TokenOutput(message.rid, [], len(message.input_ids), 0, FinishReason.ERROR, error=str(err))
            self.to_frontends[message.frontend_id].send(encode(TokenBatch([output])))
            return
        self.frontend_of[message.rid] = message.frontend_id
        self.counters.on_request(len(message.input_ids))

    def control(self, message: ControlRequest) -> None:
        reply_to = self.to_frontends[message.frontend_id]
        if message.kind == "stats":
            reply_to.send(encode(self.counters.snapshot(self.scheduler, message.token)))
        elif message.kind == "flush_cache":
            ok = self.scheduler.flush_cache()
            detail = "" if ok else "requests are queued or running; flush the cache when the server is idle"
            reply_to.send(encode(ControlReply(message.token, ok, detail)))
        else:
            reply_to.send(encode(ControlReply(message.token, False, f"unknown control request {message.kind!r}")))

    def emit(self, outputs: list[TokenOutput]) -> None:
        batches: dict[int, list[TokenOutput]] = {}
        for out in outputs:
            frontend_id = self.frontend_of.get(out.rid)
            if frontend_id is None:
                continue
            batches.setdefault(frontend_id, []).append(out)
            if out.finish_reason is not None:
                del self.frontend_of[out.rid]
        for frontend_id, batch in batches.items():
            self.to_frontends[frontend_id].send(encode(TokenBatch(batch)))

    def close(self) -> None:
        self.to_worker.send(encode(ShutdownWorker()))
        self.ctx.destroy(linger=200)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def run_scheduler(
    config: SchedulerConfig, addresses: Addresses, num_frontends: int, overlap: bool, log_level: str,
    ready: Connection,
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how Ctrl-C ends the server
    signal.signal(signal.SIGTERM, _exit_on_signal)  # run `finally`: the worker is told to stop
    loop = SchedulerLoop(Scheduler(config), addresses, num_frontends, overlap)
    ready.send_bytes(b"ready")
    ready.close()
    try:
        loop.run()
    finally:
        loop.close()
