"""Scheduler process: one loop — drain inbox, schedule, send plan, receive result, update, emit tokens.

With overlap (the default) two steps may be in flight: step N+1 is planned and sent while the worker
runs step N, so the worker never waits for the scheduler. Requests are admitted, aborted and
answered between plans; a request that can never run, or finds --max-queue requests waiting, is
answered at once with an error. An exception while admitting one request fails that request only;
one while planning, applying a step or aborting leaves the state unknown and stops the server.
"""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import zmq

from crane_mp.heap import malloc_trim
from crane_mp.ipc import Addresses, encode, make_socket, scheduler_decoder
from crane_mp.logs import LogSettings, configure_logging
from crane_mp.protocol import (
    AbortNamed,
    AbortRequest,
    ControlReply,
    ControlRequest,
    ErrorKind,
    DropLora,
    EngineState,
    FrontendRestarted,
    GenerateRequest,
    GrammarReady,
    LoadLora,
    LoadWeights,
    LoraLoaded,
    PrepareGrammar,
    ResidencyDone,
    ShutdownWorker,
    Sleep,
    StepResult,
    SwapWeights,
    TokenBatch,
    TokenOutput,
    WakeUp,
)
from crane_mp.scheduler.adapters import AdapterError, AdapterTable
from crane_mp.scheduler.request import FinishReason, Request
from crane_mp.scheduler.residency import SLEEP_LEVELS, ResidencyState, Waiter
from crane_mp.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from crane_mp.scheduler.stats import EngineCounters

log = logging.getLogger("crane_mp.scheduler")
# Preemptions closer together than this are one burst: one warning, not one per step.
_PREEMPTION_BURST_GAP = 10.0
# How long a send waits for a frontend's socket before taking the frontend for gone (see _send).
_CONNECT_WAIT_MS = 200


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
        self.named: dict[str, set[int]] = {}  # client-given name -> rids (AbortNamed)
        self.names_of: dict[int, list[str]] = {}
        self.steps_in_flight = 0
        self.step_started = 0.0
        self.last_preemption = -_PREEMPTION_BURST_GAP
        self.preemptions_seen = 0
        self.admitted: dict[int, list[TokenOutput]] = {}  # frontend id -> acknowledgements to send
        # Constrained requests whose matcher the worker is building (PrepareGrammar): not yet scheduled.
        self.awaiting_grammar: dict[int, GenerateRequest] = {}
        self.unreachable: set[int] = set()  # frontends whose socket is gone (died; see _send)
        self.adapters = AdapterTable(scheduler.config.lora_modules, scheduler.config.max_loras)
        self.load_tokens: dict[str, int] = {}  # adapter name -> the control token of its load request
        config = scheduler.config
        self.residency = ResidencyState(config.weights_path, config.sleep_idle_seconds, config.sleep_level)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        stalled = False
        trim = malloc_trim()
        served_since_trim = False  # a quiet second after serving: give the heap's free pages back
        while True:
            # Plan ahead only once a stream has produced tokens: the steps before that are long
            # prefills, and a plan made at once would miss the rest of a burst still arriving. Nor while
            # a speculating step runs: its requests' next inputs are known only from its result.
            ahead = self.scheduler.is_streaming and not self.scheduler.speculating
            limit = self.max_in_flight if ahead else 1
            # Wait while a step runs or nothing is queued (bounded, so signals are handled promptly);
            # otherwise only drain what has already arrived and plan the next step.
            steps_allowed = self.residency.steps_allowed
            plan_in = self._plan_ahead_in(ahead)
            can_plan = self.scheduler.has_work and self.steps_in_flight < limit and not stalled and steps_allowed
            timeout = int(plan_in * 1000) if can_plan else self._wait_ms()
            if poller.poll(timeout):
                stalled = False
                while True:
                    try:
                        frame = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.receive(frame)
                self._acknowledge()
                served_since_trim = True
            elif served_since_trim and trim is not None and not self.scheduler.has_work and not self.steps_in_flight:
                trim(0)
                served_since_trim = False
            self._tend_residency()
            due = not self._plan_ahead_in(ahead)
            if self.steps_in_flight < limit and not stalled and self.residency.steps_allowed and due:
                plan = self.scheduler.schedule()
                self._warn_on_preemption()
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

    def _plan_ahead_in(self, ahead: bool) -> float:
        """Seconds until the plan ahead of the step in flight is due (0: now): late in that step, so that
        requests arriving meanwhile join it (step_clock.py). Within the poller's millisecond it is due:
        a wait rounded up could outlast a short step."""
        if not ahead or self.steps_in_flight != 1:
            return 0.0
        wait = self.step_started + self.scheduler.plan_ahead_delay() - time.monotonic()
        return wait if wait >= 0.001 else 0.0

    def receive(self, frame: bytes) -> None:
        """One inbox frame. The sockets are private to this server's processes, but a frame that is not
        a message, or names a frontend that does not exist, is dropped with a warning, never a crash."""
        try:
            message = scheduler_decoder.decode(frame)
        except msgspec.DecodeError as err:
            log.warning("dropped a malformed message on the scheduler's inbox: %s", err)
            return
        frontend_id = getattr(message, "frontend_id", 0)
        if not 0 <= frontend_id < len(self.to_frontends):
            log.warning("dropped a %s from frontend %d (there are %d)", type(message).__name__, frontend_id,
                        len(self.to_frontends))
            return
        if isinstance(message, (GenerateRequest, ControlRequest, FrontendRestarted)):
            self.unreachable.discard(frontend_id)  # it speaks: its own socket is connected (it connects first)
        self.handle(message)

    def handle(self, message) -> None:
        if isinstance(message, StepResult):
            self.steps_in_flight -= 1
            outputs = self.scheduler.update(message)
            now = time.monotonic()
            self.counters.on_step(outputs, now - self.step_started)
            if message.expert_tokens:
                self.counters.on_routing(message.expert_tokens)
            self.step_started = now  # the next step in flight started when this one ended
            self.emit(outputs)
        elif isinstance(message, GenerateRequest):
            self.admit(message)
        elif isinstance(message, AbortRequest):
            self.abort(message.rid)
        elif isinstance(message, AbortNamed):
            for rid in list(self.named.get(message.name, ())):
                self.abort(rid)
            for rid in [rid for rid, waiting in self.awaiting_grammar.items() if message.name in waiting.names]:
                self.abort(rid)
        elif isinstance(message, ControlRequest):
            self.control(message)
        elif isinstance(message, LoraLoaded):
            self.lora_loaded(message)
        elif isinstance(message, GrammarReady):
            self.grammar_ready(message)
        elif isinstance(message, FrontendRestarted):
            self.forget_frontend(message.frontend_id)
        elif isinstance(message, ResidencyDone):
            self.residency_done(message)

    def admit(self, message: GenerateRequest) -> None:
        """Queue a request; a constrained one first waits for the worker to build its grammar's matcher
        (vLLM's WAITING_FOR_FSM), so that no step stalls building it."""
        if message.sampling.grammar is not None:
            self.awaiting_grammar[message.rid] = message
            self.to_worker.send(encode(PrepareGrammar(message.rid, message.sampling.grammar)))
            return
        self._queue(message)

    def forget_frontend(self, frontend_id: int) -> None:
        """A frontend died and was started again: nobody waits for what its last life sent."""
        orphans = [rid for rid, owner in self.frontend_of.items() if owner == frontend_id]
        orphans += [rid for rid, waiting in self.awaiting_grammar.items() if waiting.frontend_id == frontend_id]
        if orphans:
            log.warning("frontend %d restarted: aborting the %d requests its last life left", frontend_id, len(orphans))
        for rid in orphans:
            self.abort(rid)
        self._announce_adapters()  # the new life knows only the adapters it was started with
        self._announce_state()

    def grammar_ready(self, message: GrammarReady) -> None:
        waiting = self.awaiting_grammar.pop(message.rid, None)
        if message.error:  # nothing was prepared
            if waiting is not None:
                self._end(waiting, FinishReason.ERROR, message.error, ErrorKind.INVALID)
            return
        if waiting is None or not self._queue(waiting):  # aborted meanwhile, or refused
            self.scheduler.forget_on_worker(message.rid)

    def _queue(self, message: GenerateRequest) -> bool:
        """Hand a request to the scheduler; False when it was refused (and answered)."""
        lora_id = message.sampling.lora_id
        if lora_id and lora_id not in self.adapters.ids:  # unloaded while the request was on its way
            self._refuse(message, "the LoRA adapter this request names is no longer loaded", ErrorKind.INVALID)
            return False
        try:
            req = Request(message.rid, message.input_ids, message.sampling, arrival_time=message.arrival_time,
                          media=message.media)
            self.scheduler.add_request(req)
        except RequestRejected as err:
            self._refuse(message, str(err), err.kind)
            return False
        except Exception:
            log.exception("admitting request %d failed", message.rid)
            self._refuse(message, "internal error while admitting the request", ErrorKind.INTERNAL)
            return False
        self.frontend_of[message.rid] = message.frontend_id
        self.admitted.setdefault(message.frontend_id, []).append(TokenOutput(message.rid, [], len(message.input_ids), 0))
        self.counters.on_request(len(message.input_ids))
        if message.names:
            self.names_of[message.rid] = message.names
            for name in message.names:
                self.named.setdefault(name, set()).add(message.rid)
        return True

    def _acknowledge(self) -> None:
        """One empty output per admitted request, batched per frontend: streams answer 200 only then."""
        for frontend_id, outputs in self.admitted.items():
            self._send(frontend_id, encode(TokenBatch(outputs)))
        self.admitted.clear()

    def _refuse(self, message: GenerateRequest, error: str, kind: ErrorKind) -> None:
        self._end(message, FinishReason.ERROR, error, kind)

    def _end(self, message: GenerateRequest, reason: FinishReason, error: str | None = None,
             kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        """Finish a request that was never scheduled."""
        output = TokenOutput(message.rid, [], len(message.input_ids), 0, reason, error=error, error_kind=kind)
        self._send(message.frontend_id, encode(TokenBatch([output])))

    def abort(self, rid: int) -> None:
        waiting = self.awaiting_grammar.pop(rid, None)
        if waiting is not None:
            self._end(waiting, FinishReason.ABORT)
            return
        out = self.scheduler.abort_request(rid)
        if out is not None:
            self.emit([out])

    def _warn_on_preemption(self) -> None:
        count = self.scheduler.num_preemptions
        if count == self.preemptions_seen:
            return
        now = time.monotonic()
        if now - self.last_preemption > _PREEMPTION_BURST_GAP:
            sched = self.scheduler
            log.warning(
                "KV cache full: preempting (requests resume losslessly later); %d running, %d waiting, "
                "%d preemptions so far. Fewer concurrent requests or a larger --gpu-memory-limit avoid it",
                len(sched.running), len(sched.waiting), count,
            )
        self.last_preemption, self.preemptions_seen = now, count

    def control(self, message: ControlRequest) -> None:
        def reply_to(data: bytes) -> None:
            self._send(message.frontend_id, data)

        if message.kind == "stats":
            age = time.monotonic() - self.step_started if self.steps_in_flight else 0.0
            reply_to(encode(self.counters.snapshot(self.scheduler, message.token, age, len(self.awaiting_grammar))))
        elif message.kind == "sync":  # answered after every state announced to that frontend before it
            reply_to(encode(ControlReply(message.token, True)))
        elif message.kind == "flush_cache":
            ok = self.scheduler.flush_cache()
            detail = "" if ok else "requests are queued or running; flush the cache when the server is idle"
            reply_to(encode(ControlReply(message.token, ok, detail)))
        elif message.kind in ("load_lora", "unload_lora"):
            self.change_adapters(message)
        elif message.kind == "sleep":
            self.request_sleep(message)
        elif message.kind == "wake_up":
            self.residency.wake_waiters.append(Waiter(message.token, message.frontend_id))
            self._tend_residency()
        elif message.kind == "update_weights":
            self.request_new_weights(message)
        else:
            reply_to(encode(ControlReply(message.token, False, f"unknown control request {message.kind!r}")))

    # ---- sleep, wake-up, new weights (residency.py) --------------------------------------------------

    def _wait_ms(self) -> int:
        """How long the loop may block on its inbox: 1 s, or less when an idle sleep falls due sooner."""
        due = self.residency.seconds_to_idle_sleep(time.monotonic())
        return 1000 if due is None else max(1, min(1000, int(due * 1000) + 1))

    def _tend_residency(self) -> None:
        """Start whatever change of residency is due: a wake-up for queued work, the swap once the old
        weights' requests are done, a sleep asked for (once the last steps end) or fallen due."""
        r, sched = self.residency, self.scheduler
        now = time.monotonic()
        busy = bool(sched.requests or self.steps_in_flight or self.awaiting_grammar or sched.has_work)
        if busy:
            r.last_busy = now
        if r.changing is not None:
            return
        if r.pending_level and (sched.requests or self.awaiting_grammar):
            r.pending_level = 0
            for waiter in r.sleep_waiters:
                self._send(waiter.frontend_id, encode(ControlReply(waiter.token, False, "requests arrived before "
                                                                   "the model could sleep", 409)))
            r.sleep_waiters.clear()
        if r.level and (sched.requests or r.wake_waiters):
            self._to_worker_change("wake", WakeUp())
        elif r.level == 0 and r.wake_waiters and not r.pending_level:
            self._reply_all(r.wake_waiters, True)
        elif r.reload_read and sched.drained and not self.steps_in_flight:
            self._to_worker_change("swap", SwapWeights())
        elif r.pending_level and not busy:
            level, r.pending_level = r.pending_level, 0
            self._start_sleep(level)
        elif not busy and r.idle_sleep_due(now):
            log.info("idle for %.0f s: the model sleeps (level %d)", r.idle_sleep_seconds, r.idle_sleep_level)
            self._start_sleep(r.idle_sleep_level)

    def _to_worker_change(self, kind: str, message) -> None:
        self.residency.changing = kind
        self.to_worker.send(encode(message))

    def _start_sleep(self, level: int) -> None:
        self.scheduler.flush_cache()  # the KV the cache points into is freed
        self.residency.asked_level = level
        self._to_worker_change("sleep", Sleep(level))

    def request_sleep(self, message: ControlRequest) -> None:
        """Refused while requests are queued or running; otherwise the sleep starts once the steps in
        flight (the last requests' ends) are done, and is answered when the memory is freed."""
        r = self.residency
        if message.level not in SLEEP_LEVELS:
            self._send(message.frontend_id, encode(ControlReply(message.token, False, "level must be 1 or 2", 400)))
            return
        if r.level >= message.level and r.changing is None:
            self._send(message.frontend_id, encode(ControlReply(message.token, True)))
            return
        busy = r.busy_reason(len(self.scheduler.requests) + len(self.awaiting_grammar))
        if busy is not None:
            self._send(message.frontend_id, encode(ControlReply(message.token, False, busy, 409)))
            return
        r.sleep_waiters.append(Waiter(message.token, message.frontend_id))
        r.pending_level = max(r.pending_level, message.level)
        self._tend_residency()

    def request_new_weights(self, message: ControlRequest) -> None:
        r = self.residency
        if r.reload is not None:
            reply = ControlReply(message.token, False, f"new weights from {r.reload_path} are being loaded", 409)
            self._send(message.frontend_id, encode(reply))
            return
        r.reload, r.reload_path = Waiter(message.token, message.frontend_id), message.path
        self.to_worker.send(encode(LoadWeights(message.path)))

    def residency_done(self, message: ResidencyDone) -> None:
        r = self.residency
        if message.kind == "load":
            if message.error:
                waiter, r.reload = r.reload, None
                if waiter is not None:
                    self._send(waiter.frontend_id, encode(ControlReply(waiter.token, False, message.error, 400)))
                return
            r.reload_read = True
            self.scheduler.hold_new = True  # requests not started yet wait for the new weights
            return
        r.changing = None
        # Every frontend hears of the new state before the one that asked is answered.
        if message.kind == "sleep":
            r.level = r.asked_level
            self._announce_state()
            self._reply_all(r.sleep_waiters, True)
        elif message.kind == "wake":
            r.level, r.last_busy = 0, time.monotonic()
            self._announce_state()
            self._reply_all(r.wake_waiters, True)
        elif message.kind == "swap":
            r.reload_read = False
            self.scheduler.hold_new = False
            if not message.error:
                r.level, r.weights_path = 0, message.weights_path
                self.scheduler.pool.flush()  # the cached prefixes' KV came from the old weights
            self._announce_state()
            waiter, r.reload = r.reload, None
            if waiter is not None:
                reply = ControlReply(waiter.token, not message.error, message.error or message.weights_path,
                                     400 if message.error else 0)
                self._send(waiter.frontend_id, encode(reply))

    def _reply_all(self, waiters: list[Waiter], ok: bool) -> None:
        for waiter in waiters:
            self._send(waiter.frontend_id, encode(ControlReply(waiter.token, ok)))
        waiters.clear()

    def _announce_state(self) -> None:
        state = encode(EngineState(self.residency.level, self.residency.weights_path))
        for frontend_id in range(len(self.to_frontends)):
            self._send(frontend_id, state)

    def change_adapters(self, message: ControlRequest) -> None:
        """Load (through the worker, answered when it reports back) or unload a LoRA adapter."""
        if self.residency.level or self.residency.changing or self.residency.reload is not None:
            reply = ControlReply(message.token, False, "the model is asleep or changing weights: wake it (POST "
                                 "/wake_up) or wait for the new weights, then change adapters", 409)
            self._send(message.frontend_id, encode(reply))
            return
        try:
            if message.kind == "load_lora":
                adapter = self.adapters.reserve(message.name, message.path)
                self.to_worker.send(encode(LoadLora(message.token, message.frontend_id, adapter)))
                return
            loaded = self.adapters.loaded.get(message.name)
            users = 0 if loaded is None else sum(
                1 for r in self.scheduler.requests.values() if r.sampling.lora_id == loaded.lora_id)
            adapter = self.adapters.remove(message.name, users)
        except AdapterError as err:
            reply = ControlReply(message.token, False, str(err), err.status)
            self._send(message.frontend_id, encode(reply))
            return
        self.to_worker.send(encode(DropLora(adapter.lora_id)))
        self._announce_adapters()
        self._send(message.frontend_id, encode(ControlReply(message.token, True)))

    def lora_loaded(self, message: LoraLoaded) -> None:
        self.adapters.finish_load(message.adapter, not message.error)
        if not message.error:
            self._announce_adapters()
        reply = ControlReply(message.token, not message.error, message.error, 400 if message.error else 0)
        self._send(message.frontend_id, encode(reply))

    def _announce_adapters(self) -> None:
        registry = encode(self.adapters.registry())
        for frontend_id in range(len(self.to_frontends)):
            self._send(frontend_id, registry)

    def _send(self, frontend_id: int, data: bytes) -> None:
        """To one frontend. A frontend that died has no socket connected until the launcher has started
        it again, and a send would block every other frontend's streams meanwhile: past a short wait
        (a live frontend's socket connects within a millisecond of its first message) it is marked
        unreachable and what it would have read, which belongs to requests nobody waits for, is dropped
        until it speaks again."""
        socket = self.to_frontends[frontend_id]
        try:
            socket.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        if frontend_id not in self.unreachable and socket.poll(_CONNECT_WAIT_MS, zmq.POLLOUT):
            socket.send(data, zmq.NOBLOCK)
            return
        if frontend_id not in self.unreachable:
            log.warning("frontend %d is not connected; dropping what is sent to it until it is back", frontend_id)
            self.unreachable.add(frontend_id)

    def emit(self, outputs: list[TokenOutput]) -> None:
        batches: dict[int, list[TokenOutput]] = {}
        for out in outputs:
            frontend_id = self.frontend_of.get(out.rid)
            if frontend_id is None:
                continue
            batches.setdefault(frontend_id, []).append(out)
            if out.finish_reason is not None:
                del self.frontend_of[out.rid]
                for name in self.names_of.pop(out.rid, ()):
                    rids = self.named[name]
                    rids.discard(out.rid)
                    if not rids:
                        del self.named[name]
        for frontend_id, batch in batches.items():
            self._send(frontend_id, encode(TokenBatch(batch)))

    def close(self) -> None:
        try:  # never block: with the worker gone, a PUSH socket would wait for it forever
            self.to_worker.send(encode(ShutdownWorker()), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.ctx.destroy(linger=200)


def _exit_on_signal(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: not again inside the interpreter's clean-up
    raise SystemExit(0)


def run_scheduler(
    config: SchedulerConfig, addresses: Addresses, num_frontends: int, overlap: bool, logs: LogSettings,
    ready: Connection,
) -> None:
    configure_logging(logs)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how Ctrl-C ends the server
    signal.signal(signal.SIGTERM, _exit_on_signal)  # run `finally`: the worker is told to stop
    loop = SchedulerLoop(Scheduler(config), addresses, num_frontends, overlap)
    ready.send_bytes(b"ready")
    ready.close()
    try:
        loop.run()
    finally:
        loop.close()
