"""Scheduler process: one loop — drain inbox, schedule, send plan, receive result, update, emit tokens.

One step is in flight at a time. Requests are admitted, aborted and answered between steps; a
request that can never run is answered at once with an error instead of being queued.
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
    ControlRequest,
    GenerateRequest,
    ShutdownWorker,
    StepResult,
    TokenBatch,
    TokenOutput,
)
from crane_mp.scheduler.request import FinishReason, Request
from crane_mp.scheduler.scheduler import RequestOutput, RequestRejected, Scheduler, SchedulerConfig
from crane_mp.scheduler.stats import EngineCounters

log = logging.getLogger("crane_mp.scheduler")


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, addresses: Addresses, num_frontends: int) -> None:
        self.scheduler = scheduler
        self.ctx = zmq.Context()
        self.inbox = make_socket(self.ctx, zmq.PULL, addresses.scheduler_inbox, bind=True)
        self.to_worker = make_socket(self.ctx, zmq.PUSH, addresses.worker_inbox, bind=True)
        self.to_frontends = [
            make_socket(self.ctx, zmq.PUSH, addresses.frontend_inbox(i), bind=True) for i in range(num_frontends)
        ]
        self.counters = EngineCounters()
        self.frontend_of: dict[int, int] = {}  # rid -> frontend id
        self.step_in_flight = False
        self.step_started = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            # Wait while a step runs or nothing is queued (bounded, so signals are handled promptly);
            # otherwise only drain what has already arrived and plan the next step.
            can_plan = self.scheduler.has_work and not self.step_in_flight
            timeout = 0 if can_plan else 1000
            if poller.poll(timeout):
                while True:
                    try:
                        frame = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(scheduler_decoder.decode(frame))
            if not self.step_in_flight:
                plan = self.scheduler.schedule()
                if plan is not None:
                    self.step_started = time.monotonic()
                    self.to_worker.send(encode(plan))
                    self.step_in_flight = True
                elif not self.scheduler.running:
                    self.scheduler.check_invariants()

    def handle(self, message) -> None:
        if isinstance(message, StepResult):
            self.step_in_flight = False
            outputs = self.scheduler.update(message)
            self.counters.on_step(outputs, self.step_started)
            self.emit(outputs)
        elif isinstance(message, GenerateRequest):
            self.admit(message)
        elif isinstance(message, AbortRequest):
            req = self.scheduler.abort_request(message.rid)
            if req is not None:
                out = RequestOutput(req.req_id, [], req.num_prompt_tokens, len(req.output_ids), req.finish_reason)
                out.queue_time = req.queue_time
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
        if message.kind == "stats":
            snapshot = self.counters.snapshot(self.scheduler, message.token)
            self.to_frontends[message.frontend_id].send(encode(snapshot))

    def emit(self, outputs: list[RequestOutput]) -> None:
        batches: dict[int, list[TokenOutput]] = {}
        for out in outputs:
            frontend_id = self.frontend_of.get(out.req_id)
            if frontend_id is None:
                continue
            finish = None if out.finish_reason is None else int(out.finish_reason)
            batches.setdefault(frontend_id, []).append(
                TokenOutput(
                    out.req_id, out.new_token_ids, out.num_prompt_tokens, out.num_output_tokens, finish,
                    out.stop_token_id, out.logprobs if any(lp is not None for lp in out.logprobs) else [],
                    prompt_logprobs=out.prompt_logprobs, queue_time=out.queue_time,
                )
            )
            if finish is not None:
                del self.frontend_of[out.req_id]
        for frontend_id, batch in batches.items():
            self.to_frontends[frontend_id].send(encode(TokenBatch(batch)))

    def close(self) -> None:
        self.to_worker.send(encode(ShutdownWorker()))
        self.ctx.destroy(linger=200)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)


def run_scheduler(
    config: SchedulerConfig, addresses: Addresses, num_frontends: int, log_level: str, ready: Connection
) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how Ctrl-C ends the server
    signal.signal(signal.SIGTERM, _exit_on_signal)  # run `finally`: the worker is told to stop
    loop = SchedulerLoop(Scheduler(config), addresses, num_frontends)
    ready.send_bytes(b"ready")
    ready.close()
    try:
        loop.run()
    finally:
        loop.close()
